"""The host side of tritonnorm's RMSNorm: the entry points ``rms_norm`` and
``fused_add_rms_norm``, and everything between them and the Triton kernels (``kernels``).

Read top to bottom:

* ``OPTIONS``: the launch path's switches (one ``KernelOptions``; ``OPTIONS.override(...)``
  as a context manager);
* launch configurations: frozen dataclasses, the tuning tables swept on an H200
  (``docs/benchmarks/2026-11-30-h200-kernels.md``) and the planners that pick one for a row length;
* launching: ``launch`` keeps Triton's compiled kernel and calls its bare launcher (a
  ``kernel[grid](...)`` call costs tens of µs of host time); ``LaunchCache`` records whole
  launches of shapes seen before; ``launch_traceable`` goes through
  ``torch.library.wrap_triton`` for ``torch.compile``;
* scratch memory of eager backward launches, per (device, stream);
* the host functions (``rms_norm_fwd``, ``rms_norm_bwd``, ``fused_add_rms_norm_fwd``,
  ``fused_add_rms_norm_bwd``): pick a kernel and its configuration for a shape, allocate,
  launch;
* the eager ``autograd.Function``s (``RMSNormFunction``, ``FusedAddRMSNormFunction``):
  a plain Function costs a few µs per call where a registered operator adds tens;
* the ``torch.ops.tritonnorm`` operators for ``torch.compile``: ``torch.library.triton_op``
  on PyTorch >= 2.6, whose bodies launch through ``wrap_triton`` so that Inductor launches
  the kernels from its own code and CUDA graphs capture them (bodies allocate everything
  and keep no state); opaque ``custom_op``s on PyTorch 2.4-2.5;
* the entry points, which pick the kernels, PyTorch's path or the operators.

No ``from __future__ import annotations``: PyTorch infers each operator's schema from the
real (not stringified) annotations.
"""

import contextlib
import dataclasses
import functools
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

import torch

from tritonnorm.reference import (
    KERNEL_DTYPES,
    RMSNormTorchFunction,
    check_eps,
    check_mode,
    check_out_dtype,
    check_residual,
    check_rms_norm_args,
    default_out_dtype,
    kernel_eps,
    rms_norm_reference,
)

try:  # Triton is optional: without it (or on a platform it lacks) CUDA tensors use PyTorch.
    from tritonnorm import kernels as _k

    HAS_TRITON = True
    TRITON_IMPORT_ERROR: Optional[ImportError] = None  # noqa: UP045
except ImportError as _err:  # pragma: no cover - depends on the environment
    _k = None
    HAS_TRITON = False
    TRITON_IMPORT_ERROR = _err


# ============================================================================
# Options: the launch path's switches
# ============================================================================

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _triton_version() -> tuple[int, int]:
    try:
        import triton

        major, minor = triton.__version__.split(".")[:2]
        return int(major), int(minor)
    except (ImportError, ValueError, AttributeError):  # pragma: no cover - odd installs
        return (0, 0)


def _has_cooperative_launch() -> bool:
    """Whether this Triton can make a CUDA cooperative launch (``launch_cooperative_grid``)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - a Triton without the NVIDIA backend
        return False
    return "launch_cooperative_grid" in getattr(CUDAOptions, "__dataclass_fields__", {})


@dataclass
class KernelOptions:
    """How the launchers pick and launch kernels. One instance: ``OPTIONS``."""

    direct_launch: bool = _triton_version() >= (3, 4) and not _INTERPRET
    """Launch a cached compiled kernel directly instead of through Triton's JIT dispatch,
    which rebinds and rehashes every argument on every call (tens of µs of host time).
    Needs Triton >= 3.4, whose launcher takes every argument in signature order; never
    under the interpreter. Turned off for good if the launcher is not the one we know.
    Inside the trainer's model with the kernels forced at batch 8 x 512 (host-bound; one
    H100, 2026-12-02) the step took 9-11% longer without it than with it and no plans
    (which need it); at batch 32 and in a Hugging Face Llama ~1B, level."""

    launch_plans: bool = True
    """Record each eager launch of a contiguous shape (``LaunchCache``) and replay the
    next call of that shape from the record: its addresses, one alignment test and the
    direct launcher, no argument walk. Needs ``direct_launch``. Without the plans the
    trainer's host-bound step on the kernels (batch 8 x 512, one H100) took 15-23% longer;
    device-bound steps, level."""

    cooperative_launch: bool = _has_cooperative_launch()
    """Launch kernels whose programs wait for each other as CUDA cooperative launches, so
    the driver guarantees every program is resident at once or refuses the launch."""

    coop: bool = not _INTERPRET
    """Use the cooperative long-row kernels (one read of x) where a row is longer than one
    block. The interpreter runs programs one at a time, where a wait never ends."""

    fold_dw_sum: bool = True
    """Sum the fused backward's per-program weight-gradient partials at the end of the
    backward kernel itself (its last programs to finish) instead of in a second launch.
    Only in cooperative launches (or the interpreter); shapes in
    ``NO_FOLD`` never fold. The launch it saves made the trainer's host-bound step on the
    kernels (batch 8 x 512, one H100) 9-11% shorter; device-bound steps, level."""

    dw_reduce: str = "triton"
    """How the partials are summed when not folded: "triton" (one column-sum kernel, cast
    included) or "torch" (an ATen sum, plus a cast). Each is bitwise reproducible."""

    spin_ns: int = 200
    """Nanoseconds a program waiting to sum partials sleeps between polls: the programs
    still running need the L2 bandwidth the poll would take."""

    max_fused_block_fwd: int = 32768
    """Longest power-of-two row block the fused forward takes; longer rows go to the
    long-row kernels. Tests lower it to reach those kernels on small rows."""

    max_fused_block_bwd: int = 16384
    """The same for the backward (it holds x and dy, so half the forward's)."""

    loop_chunk: int = 32768
    """Columns per chunk of the two-pass forward at 2-byte dtypes (half at float32): 64 KiB
    per program in flight."""

    loop_chunk_bwd: int = 8192
    """Columns per slice of the two-pass backward."""

    eager_op: bool = False
    """Route eager calls through the registered ``torch.ops.tritonnorm`` operators (as
    compiled code does) instead of the autograd.Function: for tests and benchmarks."""

    interpret_cpu: bool = False
    """Let ``rms_norm`` and ``fused_add_rms_norm`` run the kernels on CPU tensors, as on
    CUDA ones, under ``TRITON_INTERPRET=1`` (ignored otherwise): for tests of whole models
    on a machine without a GPU."""

    eager_dispatch: str = "auto"
    """Which path an eager call on CUDA takes: "kernels" (always the Triton kernels),
    "torch" (always PyTorch's ``F.rms_norm``, fused on CUDA since PyTorch 2.9, with the
    same casting semantics) or "auto": PyTorch's where x has fewer elements than
    ``torch_below`` says for its dtype (host-bound calls, where the kernels' device-time
    advantage does not repay their host cost), the kernels otherwise. Without
    ``F.rms_norm`` (PyTorch < 2.4... never here, but an odd build) the kernels always.
    Under ``torch.compile`` ``compiled_dispatch`` decides instead."""

    torch_below: dict = dataclasses.field(default_factory=lambda: {
        "torch.bfloat16": 0, "torch.float16": 0, "torch.float32": 1 << 23})
    """The "auto" rule: elements of x (rows x hidden) below which an eager call takes
    PyTorch's path, by x's dtype (``str(dtype)``). Measured on one H200 (torch 2.11,
    2026-12-02, ``benchmarks/kernel_table.py --crossover`` and ``benchmarks/in_model.py``):
    in 16-bit dtypes the kernels' eager forward+backward was at or below ``F.rms_norm``'s at
    every size from 2 M to 410 M elements (its fused backward takes 2-5x the device time),
    so "auto" never picks PyTorch there. In float32 (the residual stream under autocast),
    inside whole models: the trainer's at batch 8 x 512 (3-4 M elements a norm) stepped 1-2%
    faster on ``F.rms_norm``'s path, at 32 x 512 (13-17 M) 11% slower than on the kernels,
    and a Hugging Face Llama at 16.8 M 4% slower: so float32 calls below 8.4 M elements.
    PyTorch < 2.9 has no fused kernel: "auto" then never picks it."""

    compiled_dispatch: str = "auto"
    """Which path a call traced by ``torch.compile`` takes: "kernels" (the registered
    ``torch.ops.tritonnorm`` operators: Inductor launches our kernels, one opaque pair per
    norm), "inductor" (the plain-PyTorch formula of ``rms_norm_reference``, for which
    Inductor generates its own kernels and fuses them with the neighbouring element-wise
    work) or "auto": Inductor's for ``rms_norm`` and for a ``fused_add_rms_norm`` below
    ``torch_below`` (a host-bound call, as in eager), our kernels for a larger fused add.
    A plain norm's neighbours (the residual add a model does before it, casts after it)
    are element-wise work Inductor fuses into one pass with the norm, which an opaque
    kernel pair prevents: in a compiled Hugging Face Llama (1B, 8 x 1,024, one H200,
    2026-12-02) the kernels made the step 3% slower than Inductor's own norm, Inductor's
    path ran level. The fused add already does that work in one pass each way; where it is
    small the opaque operator's host cost shows: in the trainer's small model at batch 8 x
    512 (one H100, 2026-12-02) our kernels stepped at 0.921x nn.RMSNorm's, Inductor's
    formula at 0.984x (level within that run's noise)."""

    def override(self, **changes) -> contextlib.AbstractContextManager:
        """Context manager: set some fields, restore them on exit."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"unknown tritonnorm option(s): {', '.join(sorted(unknown))}")
        return self._override(changes)

    @contextlib.contextmanager
    def _override(self, changes: dict) -> Iterator['KernelOptions']:
        saved = {name: getattr(self, name) for name in changes}
        for name, value in changes.items():
            setattr(self, name, value)
        try:
            yield self
        finally:
            for name, value in saved.items():
                setattr(self, name, value)


OPTIONS = KernelOptions()


# ============================================================================
# Launch configurations and their tuning tables
# ============================================================================

def cdiv(a: int, b: int) -> int:
    # Plain integer arithmetic: triton.cdiv is a constexpr_function in recent Triton, and
    # its host-side call costs microseconds on the hot path.
    return (a + b - 1) // b


def next_pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << (int(n) - 1).bit_length())


@dataclass(frozen=True)
class FwdConfig:
    """The fused ("rows") forward."""

    block_r: int
    """Rows per program."""
    num_warps: int
    chunk: int = 0
    """0: x is read once (``_k.fwd_rows_kernel``). > 0: read twice, ``chunk`` columns at a
    time, the second time from L2 (``_k.fwd_rows_reread_kernel``): one chunk in registers
    instead of a whole tile lets more programs share an SM."""
    even: bool = False
    """Drop the masks of the re-reading forward when the shape allows it."""


@dataclass(frozen=True)
class BwdConfig:
    """The fused persistent backward."""

    block_r: int
    num_warps: int
    programs_per_sm: int = 1
    row_sum: bool = False
    """Fold each tile's rows into a [BLOCK_H] weight-gradient accumulator (fewer
    registers, so taller tiles fit) instead of keeping the tile's shape."""
    stages: int = 1
    """1: the next tile is prefetched into registers by hand. > 1: Triton's pipeliner
    keeps ``stages - 1`` tiles in flight through shared memory (cp.async), which 16-bit
    rows need: one small tile in flight does not cover the memory latency."""


# The re-read pays where a whole tile in registers is 8-16 KiB per program; 4 rows per
# program at 16-bit x 1024 keeps enough loads in flight without spilling.
FWD_TUNED: dict[tuple[int, int], FwdConfig] = {
    (4, 1024): FwdConfig(1, 4), (4, 2048): FwdConfig(2, 16, 2048),
    (4, 4096): FwdConfig(1, 16, 2048), (4, 8192): FwdConfig(1, 16, 4096, even=True),
    (2, 1024): FwdConfig(4, 8), (2, 2048): FwdConfig(1, 4),
    (2, 4096): FwdConfig(1, 8, 2048), (2, 8192): FwdConfig(1, 16, 4096, even=True),
}
# Pipelining pays in 16-bit at every H; in float32 one register tile is already 16-32 KiB
# at H >= 4096, and the pipeliner's shared memory then costs occupancy.
BWD_TUNED: dict[tuple[int, int], BwdConfig] = {
    (4, 1024): BwdConfig(4, 8, stages=3), (4, 2048): BwdConfig(4, 8),
    (4, 4096): BwdConfig(2, 16), (4, 8192): BwdConfig(1, 8),
    (2, 1024): BwdConfig(2, 4, 2, True, 4), (2, 2048): BwdConfig(4, 4, 1, True, 3),
    (2, 4096): BwdConfig(2, 8, stages=3), (2, 8192): BwdConfig(1, 16, stages=3),
    (4, 16384): BwdConfig(1, 16), (2, 16384): BwdConfig(1, 16),
}
# Shapes whose backward does not fold the weight-gradient sum into itself: at float32 x
# 4096 the kernel runs 16 warps at 128 registers each and the fold's tail measured slower.
NO_FOLD = {(4, 4096)}


@dataclass(frozen=True)
class LoopConfig:
    """The two-pass kernels for rows longer than a fused block."""

    fwd_warps: int = 16
    fwd_programs_per_sm: int = 1
    """One program per SM keeps the rows in flight (about 34 MB at 131,072 columns) inside
    L2, so the second read of a row mostly hits it."""
    bwd_warps: int = 8
    bwd_programs_per_sm: int = 2


LOOP = LoopConfig()


@dataclass(frozen=True)
class CoopConfig:
    """A cooperative long-row kernel: a row split over a group of co-resident programs."""

    block_bytes: int
    """Bytes of a row per program (of x; in the backward, of x and of dy each)."""
    num_warps: int


# A 32 KiB backward slice spills; 16 KiB with 8 warps (16-bit) or 16 (float32) measured best.
COOP_FWD = {2: CoopConfig(32768, 16), 4: CoopConfig(32768, 16)}
COOP_BWD = {2: CoopConfig(16384, 8), 4: CoopConfig(16384, 16)}


def _tuned(table: dict, n_cols: int, elem_size: int, default) -> tuple[int, object]:
    """(BLOCK_H, the tuned config of rows of ``n_cols``, or ``default(block_h)``)."""
    block_h = next_pow2(n_cols, 16)
    cfg = table.get((elem_size, block_h))
    return block_h, default(block_h) if cfg is None else cfg


@functools.lru_cache(maxsize=1024)
def fwd_config(n_cols: int, elem_size: int) -> tuple[int, FwdConfig]:
    """(BLOCK_H, config) of the fused forward for rows of ``n_cols``."""
    def default(block_h: int) -> FwdConfig:
        # Short rows: several per program so each moves a few KiB; long rows: one.
        block_r = max(1, min(64, 4096 // block_h))
        return FwdConfig(block_r, max(1, min(16, block_r * block_h * elem_size // 2048)))
    return _tuned(FWD_TUNED, n_cols, elem_size, default)


@functools.lru_cache(maxsize=1024)
def bwd_config(n_cols: int, elem_size: int) -> tuple[int, BwdConfig]:
    """(BLOCK_H, config) of the fused backward for rows of ``n_cols``."""
    def default(block_h: int) -> BwdConfig:
        block_r = max(1, min(64, 8192 // block_h))
        return BwdConfig(block_r, max(1, min(16, block_r * block_h // 512)))
    return _tuned(BWD_TUNED, n_cols, elem_size, default)


def fwd_is_looped(n_cols: int, forced: bool | None = None) -> bool:
    """Whether the forward needs the long-row kernels (``forced`` overrides)."""
    if forced is not None:
        return forced
    return next_pow2(n_cols, 16) > OPTIONS.max_fused_block_fwd


def bwd_is_looped(n_cols: int, forced: bool | None = None) -> bool:
    if forced is not None:
        return forced
    return next_pow2(n_cols, 16) > OPTIONS.max_fused_block_bwd


@functools.lru_cache(maxsize=1024)  # called on every backward
def fold_layout(n_cols: int, n_part: int, max_summers: int, max_tile: int = 4096
                ) -> tuple[int, int, int]:
    """(rows per load, columns per block, summers) for summing n_part partial rows, in
    tiles of at most ``max_tile`` elements (at least 16 x 8)."""
    summers = max(1, min(n_part, max_summers))
    block_c = min(1024, max(8, next_pow2(cdiv(n_cols, summers))))
    block_p = min(max(16, next_pow2(n_part)), max(16, max_tile // block_c))
    block_c = min(block_c, max(8, max_tile // block_p))
    return block_p, block_c, min(summers, cdiv(n_cols, block_c))


def coop_layout(n_rows: int, n_cols: int, block: int, max_programs: int
                ) -> tuple[int, int] | None:
    """(slices per row, groups) of a cooperative grid of at most ``max_programs``.

    A row of ``n_cols`` takes ``ceil(n_cols / block)`` slices, one program each; the grid
    holds as many whole groups as fit (never more than there are rows). None when one
    group alone would not fit: its programs could not all be resident together.
    """
    n_slices = cdiv(n_cols, block)
    n_groups = min(n_rows, max_programs // n_slices)
    return (n_slices, n_groups) if n_groups >= 1 else None


# ============================================================================
# Launching: the direct launcher and recorded launch plans
# ============================================================================

_COMPILED: dict = {}
_MAX_COMPILED = 4096


def _arg_key(a):
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, bool):
        return bool, a
    if isinstance(a, int):
        return a == 1, a % 16 == 0, -0x80000000 <= a <= 0x7FFFFFFF
    return type(a)


def _direct_args(args: tuple) -> tuple[tuple, list]:
    """(cache key of ``args``, ``args`` with each tensor replaced by its address).

    The launcher given plain addresses skips its per-pointer driver query; the callers
    allocate every tensor on the launch's device, or check that it is there.
    """
    key, out = [], []
    for a in args:
        if isinstance(a, torch.Tensor):
            ptr = a.data_ptr()  # the same key as _arg_key's, without a second call
            key.append((a.dtype, ptr % 16 == 0))
            out.append(ptr)
        else:
            key.append(_arg_key(a))
            out.append(a)
    return tuple(key), out


def _launch_hooks():
    """Triton's launch hook chains (enter, exit), or None where this Triton has none."""
    try:
        from triton import knobs
        return knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    except (ImportError, AttributeError):  # pragma: no cover - an older Triton
        return None


# Triton >= 3.6 (checked on 3.6 and 3.9): ``CompiledKernel.run(gx, gy, gz, stream,
# function, packed_metadata, launch_metadata, enter_hook, exit_hook, *args)`` is what
# ``compiled[grid](...)`` calls after building a closure and launch metadata. Calling it
# directly is only right while no launch hook is registered (a profiler such as Proton
# registers one; then the full path runs).
_HOOKS = _launch_hooks() if _triton_version() >= (3, 6) else None


def _hooks_idle() -> bool:
    return _HOOKS is not None and not (_HOOKS[0].calls or _HOOKS[1].calls)


def _jit_options(num_warps: int, cooperative: bool) -> dict:
    if cooperative:
        return {"num_warps": num_warps, "launch_cooperative_grid": True}
    return {"num_warps": num_warps}


def current_stream(device_index: int) -> int:
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream  # pragma: no cover


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launch(kernel, grid: tuple[int, int, int], args: tuple, consts: tuple, num_warps: int,
           cooperative: bool = False):
    """Launch ``kernel`` over ``grid`` with runtime ``args`` then constexpr ``consts``.

    Every kernel of this package takes its runtime arguments first and its constexprs
    last, so ``args + consts`` is its whole positional signature. ``cooperative`` asks
    for a CUDA cooperative launch where Triton offers one.
    """
    cooperative = cooperative and OPTIONS.cooperative_launch
    if not OPTIONS.direct_launch:
        kernel[grid](*args, *consts, **_jit_options(num_warps, cooperative))
        return
    # id() of the kernel rather than its hash (kernels are module globals that live as
    # long as the process); the first tensor's device and the raw current stream, which
    # is what Triton itself would read.
    device = args[0].get_device()
    spec, direct = _direct_args(args)
    key = (id(kernel), device, num_warps, cooperative, consts, spec)
    compiled = _COMPILED.get(key)
    if compiled is not None:
        stream = current_stream(device)
        try:
            if _hooks_idle():
                compiled.run(grid[0], grid[1], grid[2], stream, compiled.function,
                             compiled.packed_metadata, None, None, None, *direct, *consts)
            else:
                compiled[grid](*args, *consts, stream=stream)
            return compiled
        except (TypeError, SystemError, AttributeError):  # pragma: no cover - another Triton
            OPTIONS.direct_launch = False
            _COMPILED.clear()
            kernel[grid](*args, *consts, **_jit_options(num_warps, cooperative))
            return
    # The first launch goes through the JIT on the tensors' device (the compiled kernel is
    # loaded there, and the direct path launches it on that device's stream).
    with torch.cuda.device(device):
        compiled = kernel[grid](*args, *consts, **_jit_options(num_warps, cooperative))
    if compiled is None or not hasattr(compiled, "function"):
        OPTIONS.direct_launch = False  # not the Triton we know: always go through the JIT
        return
    if len(_COMPILED) >= _MAX_COMPILED:
        _COMPILED.clear()
    _COMPILED[key] = compiled
    return None


_launch = launch


class LaunchCache:
    """Launches whose every argument but the tensors' addresses follows from a key.

    The launchers key a call by what fixes the grid and the scalar arguments (shapes,
    dtypes, devices, flags); once a launch through ``launch`` has been recorded, a call
    with the same key costs the addresses, one alignment test and Triton's bare launcher:
    no argument walk, no specialisation key. Only launches whose tensors were all 16-byte
    aligned are recorded; a call whose tensors are not takes the full path.

    A plan is ``(compiled, grid, tail, n_ptrs, extra)``: the kernel, its grid, its scalar
    and constexpr arguments, how many addresses come first, and whatever else the caller
    recorded with it (the forward: a tensor to allocate its per-row statistic like).
    """

    def __init__(self) -> None:
        self._plans: dict = {}

    def get(self, key):
        """The recorded plan for ``key``, or None where there is none or it cannot be
        used now (direct launches off, a launch hook registered)."""
        if not (OPTIONS.launch_plans and OPTIONS.direct_launch) or not _hooks_idle():
            return None
        return self._plans.get(key)

    @staticmethod
    def launch(plan, stream: int, ptrs: tuple) -> bool:
        """Launch ``plan`` on the raw CUDA ``stream`` with these addresses (the kernel's
        first arguments, in order); False, launching nothing, when one of them is not
        16-byte aligned."""
        align = 0
        for p in ptrs:
            align |= p
        if align & 15:
            return False
        compiled, grid, tail = plan[0], plan[1], plan[2]
        compiled.run(grid[0], grid[1], grid[2], stream, compiled.function,
                     compiled.packed_metadata, None, None, None, *ptrs, *tail)
        return True

    def record(self, key, compiled, grid: tuple, args: tuple, n_ptrs: int,
               consts: tuple, extra=None) -> None:
        """Remember a launch that just ran: ``compiled`` as ``launch`` returned it, its
        arguments, of which the first ``n_ptrs`` are the tensors, and ``extra``."""
        if compiled is None or any(a.data_ptr() & 15 for a in args[:n_ptrs]):
            return
        if len(self._plans) >= _MAX_COMPILED:
            self._plans.clear()
        self._plans[key] = (compiled, grid, (*args[n_ptrs:], *consts), n_ptrs, extra)


def launch_traceable(kernel, grid: tuple[int, int, int], args: tuple, consts: tuple,
                     num_warps: int, cooperative: bool = False) -> None:
    """``launch`` through ``torch.library.wrap_triton`` (a ``triton_op``'s body).

    Never cooperative: Inductor's launcher has no such option, so callers on this path
    never fold (nothing waits for other programs).
    """
    if cooperative:
        raise ValueError("a traceable launch cannot be cooperative")
    from torch.library import wrap_triton

    wrap_triton(kernel)[grid](*args, *consts, num_warps=num_warps)


# ============================================================================
# Scratch memory per (device, stream)
# ============================================================================

# The folded weight-gradient sum's counters: two int32 (an arrival count, zero on entry and
# reset by the last arrival, and a generation word), padded to 16 bytes.
_COUNTERS: dict = {}
# Counters for launches captured into CUDA graphs: a graph may be replayed on any stream
# alongside anything, so each captured launch takes a pair of its own from a pool zeroed
# before any capture, or, when the pool is used up or was never made, one zeroed in the graph.
_COUNTER_POOLS: dict = {}
COUNTER_POOL_SIZE = 1024
# The fused backward's [programs, H] float32 partial weight gradients: they live only
# until the dweight sum that follows on the same stream. The latest shape is kept (SMs x
# programs per SM x H x 4 bytes: a few MB at most).
_PARTIALS: dict = {}


def _pick_capture_check():
    raw = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
    return raw if raw is not None else torch.cuda.is_current_stream_capturing


# Looked up once: the check runs on every eager backward.
_capturing = _pick_capture_check()


def eager_stream(x: torch.Tensor) -> tuple[int, int] | None:
    """(device, current stream) of an eager launch on ``x``'s GPU, the key of what
    launches on one stream share; None on the CPU or while a CUDA graph is captured."""
    device = x.get_device()
    if device < 0 or _capturing():
        return None
    return device, current_stream(device)


def eager_scratch(x: torch.Tensor, n_prog: int, n_cols: int
                  ) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """(raw stream, partials buffer, zeroed counters) of an eager folded backward on
    ``x``'s GPU, with one stream query for all three; None on the CPU or while a CUDA
    graph is captured (the launch then needs memory of its own)."""
    key = eager_stream(x)
    if key is None:
        return None
    counter = _COUNTERS.get(key)
    buf = _PARTIALS.get(key)
    if counter is None or buf is None or buf.shape[0] != n_prog or buf.shape[1] != n_cols:
        return key[1], partials_buffer(x, n_prog, n_cols), fold_counter(x)
    return key[1], buf, counter


def fold_counter(x: torch.Tensor) -> torch.Tensor:
    """Zeroed int32 counters for a folded backward launch on ``x``'s device."""
    key = eager_stream(x)
    if key is None:
        device = x.get_device()
        if device < 0:
            return torch.zeros(4, dtype=torch.int32)
        pool = _COUNTER_POOLS.get(device)  # capturing a CUDA graph
        if not pool:
            return torch.zeros(4, dtype=torch.int32, device=x.device)
        return pool.pop()
    device = key[0]
    counter = _COUNTERS.get(key)
    if counter is None:
        if device not in _COUNTER_POOLS:
            block = torch.zeros((COUNTER_POOL_SIZE, 4), dtype=torch.int32, device=x.device)
            _COUNTER_POOLS[device] = list(block.unbind(0))
        counter = _COUNTERS[key] = torch.zeros(4, dtype=torch.int32, device=x.device)
    return counter


def partials_buffer(x: torch.Tensor, n_prog: int, n_cols: int) -> torch.Tensor:
    """An uninitialised float32 [n_prog, n_cols] buffer for the fused backward's partials."""
    key = eager_stream(x)
    if key is None:
        return x.new_empty((n_prog, n_cols), dtype=torch.float32)
    buf = _PARTIALS.get(key)
    if buf is None or buf.shape[0] != n_prog or buf.shape[1] != n_cols:
        buf = _PARTIALS[key] = x.new_empty((n_prog, n_cols), dtype=torch.float32)
    return buf


# ============================================================================
# The host side of the kernels
# ============================================================================

# Launch shapes whose cooperative launch the driver refused (see _backward).
_FOLD_REFUSED: set = set()
# Eager launches of the rows kernels on shapes seen before (see LaunchCache): the common
# call in a training step, where host time is the whole cost of a small norm.
_FWD_PLANS = LaunchCache()
_BWD_PLANS = LaunchCache()


def _launcher(traceable: bool):
    return launch_traceable if traceable else _launch


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D (rows, H) view of ``t`` with unit column stride (copies only when it must)."""
    if t.dim() == 2 and t.stride(1) == 1:
        return t  # already rows (the common case: no reshape on the hot path)
    if t.dim() == 0 or t.stride(-1) != 1:
        t = t.contiguous()
    t2 = t.reshape(-1, t.shape[-1])
    if t2.shape[0] > 1 and t2.stride(1) != 1:
        t2 = t2.contiguous()
    return t2


def _like(t2: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The (rows, H) result ``t2`` in x's shape (a view; no copy)."""
    return t2 if x.dim() == 2 else t2.view(x.shape)


def _n_programs(x: torch.Tensor, per_sm: int) -> int:
    """Programs in a persistent grid: ``per_sm`` per SM of x's GPU, 3 on the interpreter
    (which runs programs one by one; 3 still exercises the partial sums)."""
    index = x.get_device()  # -1 for a CPU tensor
    return per_sm * sm_count(index) if index >= 0 else 3


def _coop_plan(x: torch.Tensor, n_rows: int, n_cols: int, config: dict | None,
               backward: bool = False) -> tuple[int, int, int, int] | None:
    """(BLOCK_H, slices per row, groups, num_warps) of a cooperative launch, or None where
    the two-pass kernels must serve: on the interpreter (unless a test forces ``coop``
    with one slice per row), or when one row needs more slices than the GPU has SMs."""
    coop = OPTIONS.coop if not config else config.get("coop", OPTIONS.coop)
    if not coop:
        return None
    es = x.element_size()
    cfg = (COOP_BWD if backward else COOP_FWD).get(es, CoopConfig(16384, 8))
    block, num_warps = cfg.block_bytes // es, cfg.num_warps
    if config:
        block = config.get("coop_block", block)
        num_warps = config.get("coop_warps", num_warps)
    if x.get_device() < 0 and n_cols > block:
        return None  # programs that wait for each other cannot run one at a time
    layout = coop_layout(n_rows, n_cols, block, _n_programs(x, 1))
    return None if layout is None else (block, *layout, num_warps)


#: The kernels' mode constexprs (HAS_W, OFFSET, LLAMA) of a plain RMSNorm with a weight.
_PLAIN = (True, 0.0, False)


def _mode(weight, offset: float, llama: bool) -> tuple[bool, float, bool]:
    """The mode constexprs every kernel takes last: whether there is a weight, the offset
    added to it in float32, and whether x_hat is rounded to x's dtype before the weight
    multiplies it (casting mode "llama")."""
    return (weight is not None, float(offset), bool(llama))


def _sum_partials(part: torch.Tensor, weight: torch.Tensor, traceable: bool) -> torch.Tensor:
    """Sum the [n_programs, H] float32 partial weight gradients over programs, in an order
    fixed by the buffer's shape (bitwise reproducible), in the weight's dtype."""
    if OPTIONS.dw_reduce == "torch":
        out = part.sum(dim=0)
        return out if weight.dtype == torch.float32 else out.to(weight.dtype)
    n_part, n_cols = part.shape
    out = weight.new_empty((n_cols,))
    block_c = 64 if n_cols <= 8192 else 256
    _launcher(traceable)(_k.sum_partials_kernel, (cdiv(n_cols, block_c), 1, 1),
                         (part, out, n_part, n_cols), (16, block_c), 4)
    return out


# --------------------------------------------------------------------------- forward


def rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, config: dict | None = None,
    need_rstd: bool = True, traceable: bool = False, out_dtype: torch.dtype | None = None,
    offset: float = 0.0, llama: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the forward kernel.

    Args:
        x: input (*, H) in float32/float16/bfloat16, on CUDA or (interpreter) CPU.
        weight: gain (H,), or None (no scale).
        eps: added to the mean square.
        config: overrides of the launch configuration (looped, block_r, num_warps,
            programs_per_sm, chunk, even, coop, coop_block, coop_warps) for tuning sweeps.
        need_rstd: False when no backward will follow (inference): the fused kernels
            then skip writing rstd, and None comes back in its place.
        traceable: launch through ``wrap_triton`` (a ``triton_op`` body).
        out_dtype: y's dtype (default x's): the cast a following autocast layer would
            make, done by the store instead of by a kernel of its own.
        offset: added to the weight in float32 (Gemma's ``1 + weight``: 1.0).
        llama: round x_hat to x's dtype before the weight multiplies it (casting mode
            "llama"; the weight gradient then sums dy times that rounded x_hat).

    Returns:
        (y with x's shape and ``out_dtype``, rstd of shape (rows,) in float32 or None).
    """
    y, _, rstd = _forward(x, None, weight, eps, config, need_rstd, traceable, out_dtype,
                          _mode(weight, offset, llama))
    return y, rstd


def fused_add_rms_norm_fwd(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
    need_rstd: bool = True, traceable: bool = False, config: dict | None = None,
    out_dtype: torch.dtype | None = None, offset: float = 0.0, llama: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """s = x + residual (in x's dtype), y = RMSNorm(s) * weight, in one pass over x and
    residual. Returns (y, s, rstd or None) of x's shape; s has x's dtype and y
    ``out_dtype`` (default x's). A residual of another shape or device is refused before
    any work (``_forward``)."""
    return _forward(x, residual, weight, eps, config, need_rstd, traceable, out_dtype,
                    _mode(weight, offset, llama))


def _all_contiguous(*tensors) -> bool:
    # A plain loop: a generator in all() costs more on this hot path.
    for t in tensors:  # noqa: SIM110
        if t is not None and not t.is_contiguous():
            return False
    return True


def _fwd_key(x, residual, weight, need_rstd, eps, out_dtype, mode) -> tuple:
    """What fixes the grid and scalar arguments of an eager rows forward on contiguous
    tensors, whose shape gives the rows, the columns and the row stride (see LaunchCache).
    The devices are in it because the launch takes bare addresses: a plan is only ever
    recorded for a call whose tensors share a device, so a mixed call finds none."""
    r = x if residual is None else residual
    w = x if weight is None else weight
    return (x.shape, r.shape, w.shape, x.dtype, r.dtype, w.dtype, x.get_device(),
            r.get_device(), w.get_device(), residual is None, need_rstd, eps, out_dtype, mode)


def _forward_fast(x, residual, weight, eps, need_rstd, out_dtype, mode):
    """The eager rows forward of a contiguous shape launched before; None where it does
    not apply. The outputs are allocated in x's shape, so no view is made (each costs a
    dispatcher call, several µs of host time)."""
    if not _all_contiguous(x, residual, weight):
        return None
    plan = _FWD_PLANS.get(_fwd_key(x, residual, weight, need_rstd, eps, out_dtype, mode))
    if plan is None:
        return None
    # empty_like reads shape, dtype and device from a tensor: about half the host time of
    # new_empty, which parses a shape.
    y = torch.empty_like(x, dtype=out_dtype)
    s = None if residual is None else torch.empty_like(x)
    rstd = torch.empty_like(plan[4]) if need_rstd else None
    py = y.data_ptr()
    prstd = py if rstd is None else rstd.data_ptr()  # y stands in for an unwritten rstd
    px = x.data_ptr()
    pw = px if weight is None else weight.data_ptr()  # x stands in for an absent weight
    if plan[3] == 6:  # _k.fwd_rows_kernel
        ptrs = (px, px if residual is None else residual.data_ptr(), pw, py,
                py if s is None else s.data_ptr(), prstd)
    else:  # the re-reading forward
        ptrs = (px, pw, py, prstd)
    if not LaunchCache.launch(plan, current_stream(x.get_device()), ptrs):
        return None
    return y, s, rstd


def _forward(x, residual, weight, eps, config, need_rstd, traceable, out_dtype=None,
             mode=_PLAIN):
    if not traceable and config is None:
        fast = _forward_fast(x, residual, weight, eps, need_rstd, out_dtype, mode)
        if fast is not None:
            return fast
    if weight is not None and weight.device != x.device:  # the launch takes bare addresses
        raise ValueError(f"x is on {x.device} but weight is on {weight.device}")
    if residual is not None and (residual.shape != x.shape or residual.device != x.device):
        check_residual(x, residual, kernel=True)  # raises, naming what differs
    # The row length picks the kernel and its block: under torch.compile with dynamic
    # shapes it is specialised (int()), as Inductor would have to anyway.
    n_cols = int(x.shape[-1])
    x2 = _as_rows(x)
    n_rows = x2.shape[0]
    # new_empty: same dtype and device without parsing them again (host time matters here).
    y2 = x2.new_empty((n_rows, n_cols), dtype=out_dtype)
    s2 = None if residual is None else x2.new_empty((n_rows, n_cols))
    if n_rows == 0:
        rstd = x2.new_empty((0,), dtype=torch.float32) if need_rstd else None
        s = None if s2 is None else _like(s2, x)
        return _like(y2, x), s, rstd
    # x stands in for an absent weight (HAS_W is False: nothing reads it).
    w = x2 if weight is None else weight if weight.is_contiguous() else weight.contiguous()
    looped = fwd_is_looped(n_cols, config.get("looped") if config else None)
    if residual is not None and looped:
        # Rows too long for one block: the add runs apart, then the long-row forward.
        s2 = (x2.float() + _as_rows(residual).float()).to(x.dtype)
        y, _, rstd = _forward(s2, None, weight, eps, config, need_rstd, traceable, out_dtype,
                              mode)
        return _like(y, x), _like(s2, x), rstd
    # Only the fused kernels can skip rstd (y2 then stands in for its unused pointer).
    store_rstd = need_rstd or looped
    rstd = x2.new_empty((n_rows,), dtype=torch.float32) if store_rstd else None
    launch = _launcher(traceable)
    if looped:
        _forward_long(x, x2, w, y2, rstd, n_rows, n_cols, eps, config, launch, mode)
    else:
        block_h, cfg = fwd_config(n_cols, x.element_size())
        block_r = config.get("block_r", cfg.block_r) if config else cfg.block_r
        num_warps = config.get("num_warps", cfg.num_warps) if config else cfg.num_warps
        chunk = min(config.get("chunk", cfg.chunk) if config else cfg.chunk, block_h)
        out_rstd = rstd if store_rstd else y2
        r2 = x2 if residual is None else _as_rows(residual)
        if chunk and residual is None:
            even = config.get("even", cfg.even) if config else cfg.even
            even = even and n_cols % chunk == 0 and n_rows % block_r == 0
            kernel, n_ptrs = _k.fwd_rows_reread_kernel, 4
            args = (x2, w, y2, out_rstd, n_rows, n_cols, x2.stride(0), n_cols, eps)
            consts = (block_r, chunk, even, store_rstd, *mode)
        else:
            kernel, n_ptrs = _k.fwd_rows_kernel, 6
            args = (x2, r2, w, y2, y2 if s2 is None else s2, out_rstd, n_rows, n_cols,
                    x2.stride(0), r2.stride(0), n_cols, eps)
            consts = (block_r, block_h, store_rstd, residual is not None, *mode)
        grid = (cdiv(n_rows, block_r), 1, 1)
        compiled = launch(kernel, grid, args, consts, num_warps)
        if not traceable and config is None and _all_contiguous(x, residual, weight):
            key = _fwd_key(x, residual, weight, need_rstd, eps, out_dtype, mode)
            # rstd (float32, (rows,)) as the template the fast path allocates rstd like;
            # only its shape, dtype and device are read (it keeps 4 bytes a row alive per
            # recorded shape; None when no rstd is written).
            _FWD_PLANS.record(key, compiled, grid, args, n_ptrs, consts, rstd)
    s = None if s2 is None else _like(s2, x)
    return _like(y2, x), s, (rstd if need_rstd else None)


def _forward_long(x, x2, w, y2, rstd, n_rows, n_cols, eps, config, launch, mode):
    """Rows longer than a fused block: cooperative where it can run, else two passes."""
    coop = _coop_plan(x, n_rows, n_cols, config)
    args = (x2, w, y2, rstd, n_rows, n_cols, x2.stride(0), n_cols, eps)
    if coop is not None and launch is _launch:
        block, n_slices, n_groups, num_warps = coop
        slots = torch.zeros((n_rows, n_slices), dtype=torch.int64, device=x2.device)
        launch(_k.fwd_coop_kernel, (n_groups * n_slices, 1, 1),
               (x2, w, y2, rstd, slots, n_rows, n_cols, n_slices, x2.stride(0), n_cols, eps),
               (block, next_pow2(n_slices, 16), *mode), num_warps, cooperative=True)
        return
    # One row per program at a time, read twice (sum of squares, then normalise). With
    # few programs per SM the rows in flight fit in L2, so the second read hits it.
    chunk = max(1, OPTIONS.loop_chunk * 2 // x.element_size())
    num_warps, per_sm = LOOP.fwd_warps, LOOP.fwd_programs_per_sm
    if config:
        chunk = config.get("chunk", chunk)
        num_warps = config.get("num_warps", num_warps)
        per_sm = config.get("programs_per_sm", per_sm)
    chunk = min(chunk, next_pow2(n_cols, 16))
    grid = (min(n_rows, _n_programs(x, per_sm)), 1, 1)
    launch(_k.fwd_looped_kernel, grid, args, (chunk, *mode), num_warps)


# --------------------------------------------------------------------------- backward


def rms_norm_bwd(
    grad_output: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    *,
    needs_dx: bool = True,
    needs_dw: bool = True,
    config: dict | None = None,
    traceable: bool = False,
    offset: float = 0.0,
    llama: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Run the backward kernels; never writes into ``grad_output``.

    Args:
        grad_output: dL/dy, x's shape.
        x: the forward's input.
        weight: the forward's gain (H,), or None.
        rstd: the forward's per-row 1/RMS, float32 (rows,).
        needs_dx: compute dL/dx (else None is returned in its place).
        needs_dw: compute dL/dweight (else None).
        config: overrides of the launch configuration (block_r, num_warps,
            programs_per_sm, looped, chunk, row_sum, stages, prefetch, fold, fold_tile,
            spin_ns, coop, coop_block, coop_warps) for tuning sweeps.
        traceable: launch through ``wrap_triton`` (a ``triton_op`` body).
        offset, llama: the forward's (see ``rms_norm_fwd``).

    Returns:
        (dx in x's dtype and shape or None, dweight in the weight's dtype or None).
    """
    dx, _, dw = _backward(grad_output, x, weight, rstd, needs_dx, needs_dw, config, None,
                          None, traceable, _mode(weight, offset, llama))
    return dx, dw


def fused_add_rms_norm_bwd(
    grad_y: torch.Tensor, grad_sum: torch.Tensor | None, s: torch.Tensor, weight: torch.Tensor,
    rstd: torch.Tensor, residual_dtype: torch.dtype, *, needs_dw: bool = True,
    traceable: bool = False, config: dict | None = None, offset: float = 0.0,
    llama: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Backward of ``fused_add_rms_norm_fwd``: x and residual get the same gradient, the
    norm's dx plus ``grad_sum`` (None when the sum was not used). Returns (dx in s's
    dtype, dresidual in ``residual_dtype`` (the same tensor when the dtypes agree), dweight
    or None)."""
    if grad_sum is not None and grad_sum.shape != s.shape:
        raise ValueError(f"grad_sum {tuple(grad_sum.shape)} must have the sum's shape "
                         f"{tuple(s.shape)}")
    return _backward(grad_y, s, weight, rstd, True, needs_dw, config, grad_sum,
                     residual_dtype, traceable, _mode(weight, offset, llama))


def _bwd_key(grad_output, x, weight, rstd, ds, needs_dx, needs_dw, dr_dtype, mode) -> tuple:
    """What fixes the grid and scalar arguments of an eager fused backward on contiguous
    tensors (see ``_fwd_key``)."""
    d = x if ds is None else ds
    return (x.shape, grad_output.shape, d.shape, weight.shape, x.dtype, grad_output.dtype,
            d.dtype, weight.dtype, dr_dtype, x.get_device(), grad_output.get_device(),
            d.get_device(), rstd.get_device(), weight.get_device(), ds is None, needs_dx,
            needs_dw, OPTIONS.fold_dw_sum, mode)


def _backward_fast(grad_output, x, weight, rstd, needs_dx, needs_dw, ds, dr_dtype, mode):
    """The eager, folded rows backward of a contiguous shape launched before; None where
    it does not apply. Returns (dx, dr, dweight) as ``_backward`` does, allocated in x's
    shape (no views)."""
    if not _all_contiguous(x, grad_output, ds, weight):
        return None
    plan = _BWD_PLANS.get(_bwd_key(grad_output, x, weight, rstd, ds, needs_dx, needs_dw,
                                   dr_dtype, mode))
    if plan is None:
        return None
    scratch = eager_scratch(x, plan[1][0], x.shape[-1])
    if scratch is None:  # capturing a CUDA graph: scratch memory of its own
        return None
    stream, dw_part, counter = scratch
    dx = torch.empty_like(x) if needs_dx else x
    two_outs = dr_dtype is not None and dr_dtype != x.dtype
    dr = torch.empty_like(x, dtype=dr_dtype) if two_outs else dx
    dw = torch.empty_like(weight)
    px = x.data_ptr()
    ptrs = (px, weight.data_ptr(), grad_output.data_ptr(), rstd.data_ptr(), dx.data_ptr(),
            dw_part.data_ptr(), px if ds is None else ds.data_ptr(), dr.data_ptr(),
            dw.data_ptr(), counter.data_ptr())
    if not LaunchCache.launch(plan, stream, ptrs):
        return None
    if not needs_dx:
        return None, None, dw
    return dx, (None if dr_dtype is None else dr), dw


def _backward(grad_output, x, weight, rstd, needs_dx, needs_dw, config, ds, dr_dtype,
              traceable, mode=_PLAIN):
    needs_dw = needs_dw and weight is not None
    if not traceable and config is None and needs_dw:
        fast = _backward_fast(grad_output, x, weight, rstd, needs_dx, needs_dw, ds, dr_dtype,
                              mode)
        if fast is not None:
            return fast
    w_device = x.device if weight is None else weight.device
    # The direct launch passes bare addresses: a tensor elsewhere must fail here.
    if grad_output.shape != x.shape or not (grad_output.device == x.device == w_device
                                            == rstd.device):
        raise ValueError(
            f"grad_output {tuple(grad_output.shape)} on {grad_output.device} must match x "
            f"{tuple(x.shape)} on {x.device}, with weight and rstd on the same device "
            f"(weight on {w_device}, rstd on {rstd.device})")
    n_cols = int(x.shape[-1])  # specialised under dynamic shapes, as in _forward
    x2 = _as_rows(x)
    dy2 = _as_rows(grad_output)
    n_rows = x2.shape[0]
    two_outs = dr_dtype is not None and dr_dtype != x.dtype
    if n_rows == 0 or not (needs_dx or needs_dw):
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if needs_dx else None
        dr = None if dr_dtype is None else (dx.to(dr_dtype) if two_outs else dx)
        dw = torch.zeros_like(weight) if needs_dw and n_rows == 0 else None
        return dx, dr, dw
    dx2 = x2.new_empty((n_rows, n_cols)) if needs_dx else x2
    w = x2 if weight is None else weight if weight.is_contiguous() else weight.contiguous()
    looped = bwd_is_looped(n_cols, config.get("looped") if config else None)
    if looped:
        dw = _backward_long(x, x2, w, dy2, rstd, dx2, n_rows, n_cols, needs_dx, needs_dw,
                            config, traceable, mode)
        dx = _like(dx2, x) if needs_dx else None
        if ds is not None:  # the fused add's gradient on long rows: added apart
            dx = dx.add_(ds)
        dr = None if dr_dtype is None else (dx.to(dr_dtype) if two_outs else dx)
        return dx, dr, dw
    ds2 = x2 if ds is None else _as_rows(ds)
    dr2 = x2.new_empty((n_rows, n_cols), dtype=dr_dtype) if two_outs else dx2
    plan_key = None
    if not traceable and config is None and needs_dw and _all_contiguous(x, grad_output, ds,
                                                                         weight):
        plan_key = _bwd_key(grad_output, x, weight, rstd, ds, needs_dx, needs_dw, dr_dtype,
                            mode)
    dw = _backward_rows(x, x2, w, weight, dy2, rstd, dx2, ds2, dr2, n_rows, n_cols,
                        needs_dx, needs_dw, ds is not None, two_outs, config, traceable,
                        plan_key, mode)
    if not needs_dx:
        return None, None, dw
    dx = _like(dx2, x)
    dr = None if dr_dtype is None else (_like(dr2, x) if two_outs else dx)
    return dx, dr, dw


def _backward_rows(x, x2, w, weight, dy2, rstd, dx2, ds2, dr2, n_rows, n_cols, needs_dx,
                   needs_dw, has_ds, has_dr, config, traceable, plan_key=None, mode=_PLAIN):
    """The fused persistent backward; returns dweight (None when not needed). A folded
    launch is recorded under ``plan_key`` for ``_backward_fast``."""
    block_h, cfg = bwd_config(n_cols, x.element_size())
    block_r, num_warps, per_sm = cfg.block_r, cfg.num_warps, cfg.programs_per_sm
    row_sum, stages = cfg.row_sum, cfg.stages
    if config:
        block_r = config.get("block_r", block_r)
        num_warps = config.get("num_warps", num_warps)
        per_sm = config.get("programs_per_sm", per_sm)
        row_sum = config.get("row_sum", row_sum)
        stages = config.get("stages", stages)
    n_prog = min(cdiv(n_rows, block_r), _n_programs(x, per_sm))
    dw_part = (x2.new_empty((n_prog, n_cols), dtype=torch.float32) if traceable
               else partials_buffer(x2, n_prog, n_cols))
    # Prefetch into registers only where the loop is not pipelined and two tiles fit.
    prefetch = stages == 1 and block_h <= 8192
    fold = OPTIONS.fold_dw_sum and (x.element_size(), block_h) not in NO_FOLD
    if config:
        prefetch = config.get("prefetch", prefetch)
        fold = config.get("fold", fold)
    # The folded sum makes programs wait for others: on the GPU only in a cooperative
    # launch, where the driver guarantees that every program is resident at once (never
    # in a traced launch, where n_prog may be symbolic).
    fold = (fold and needs_dw and not traceable
            and (OPTIONS.cooperative_launch or not x.is_cuda))
    refusal_key = (x.get_device(), num_warps, block_r, block_h, stages, n_prog) if fold else None
    fold = fold and refusal_key not in _FOLD_REFUSED
    args = (x2, w, dy2, rstd, dx2, dw_part, ds2, dr2, n_rows, n_cols, x2.stride(0),
            dy2.stride(0), dx2.stride(0), ds2.stride(0))
    consts = (block_r, block_h, needs_dx, needs_dw, prefetch, row_sum, stages, has_ds, has_dr)
    try:
        return _launch_fused_bwd(args, consts, weight, num_warps, fold, config, traceable,
                                 plan_key, mode)
    except RuntimeError as err:
        if not fold:
            raise
        # The driver refused to make the grid resident at once (a GPU shared under MPS
        # limits, say): from now on this shape sums its partials in a second kernel.
        warnings.warn(f"tritonnorm: cooperative backward launch refused ({err}); "
                      "summing dweight in a second kernel", RuntimeWarning, stacklevel=3)
        _FOLD_REFUSED.add(refusal_key)
        return _launch_fused_bwd(args, consts, weight, num_warps, False, config, traceable,
                                 None, mode)


def _max_summers(x: torch.Tensor) -> int:
    """How many programs may wait to sum partials: one per SM (even without a cooperative
    launch, waiters could then never hold every SM while a program they wait for is yet
    to start); one on the interpreter, which runs programs one after another."""
    index = x.get_device()
    return sm_count(index) if index >= 0 else 1


def _launch_fused_bwd(args: tuple, consts: tuple, weight: torch.Tensor, num_warps: int,
                      fold: bool, config: dict | None, traceable: bool, plan_key=None,
                      mode=_PLAIN):
    """Launch _k.bwd_rows_kernel; return dweight (None when it is not needed).

    ``args`` are the kernel's runtime arguments without DW, COUNTER and n_red, and
    ``consts`` its constexprs up to HAS_DR; this adds the folded sum's (or, without
    ``fold``, sums the partials in a second kernel).
    """
    x2, dw_part, n_cols, needs_dw = args[0], args[5], args[9], consts[3]
    if fold:
        dw = weight.new_empty((n_cols,))
        counter = fold_counter(x2)
        # Tiles of up to 32 elements per thread: all the partials a summer needs are
        # loaded at once where they fit (264 x 8 at 16-bit x 1024).
        red_p, red_c, n_red = fold_layout(
            n_cols, dw_part.shape[0], _max_summers(x2),
            (config or {}).get("fold_tile", min(4096, 1024 * num_warps)))
    else:  # dw_part stands in for the unused pointers
        dw, counter, (red_p, red_c, n_red) = dw_part, dw_part, (16, 16, 1)
    spin_ns = (config or {}).get("spin_ns", OPTIONS.spin_ns) if x2.is_cuda else 0
    grid = (dw_part.shape[0], 1, 1)
    full_args = (*args[:8], dw, counter, *args[8:], n_red)
    full_consts = (*consts, fold, red_p, red_c, spin_ns, *mode)
    compiled = _launcher(traceable)(_k.bwd_rows_kernel, grid, full_args, full_consts, num_warps,
                                    cooperative=fold)
    if fold:
        if plan_key is not None:
            _BWD_PLANS.record(plan_key, compiled, grid, full_args, 10, full_consts)
        return dw
    return _sum_partials(dw_part, weight, traceable) if needs_dw else None


def _backward_long(x, x2, w, dy2, rstd, dx2, n_rows, n_cols, needs_dx, needs_dw, config,
                   traceable, mode=_PLAIN):
    """Rows longer than a fused block; returns dweight (None when not needed)."""
    launch = _launcher(traceable)
    coop = None if traceable else _coop_plan(x, n_rows, n_cols, config, backward=True)
    if coop is not None:
        block, n_slices, n_groups, num_warps = coop
        slots = torch.zeros((n_rows, n_slices) if needs_dx else (1, 1), dtype=torch.int64,
                            device=x2.device)
        # The weight-gradient partials are accumulated even when nobody wants them (no
        # weight, or a frozen one): the kernel ran 15% faster with that accumulation in
        # its loop than without (bf16, 4,096 x 65,536 and 131,072, one H100), for a
        # partials buffer of a few MB against GBs of rows.
        dw_part = x2.new_empty((n_groups, n_cols), dtype=torch.float32)
        launch(_k.bwd_coop_kernel, (n_groups * n_slices, 1, 1),
               (x2, w, dy2, rstd, slots, dx2, dw_part, n_rows, n_cols, n_slices,
                x2.stride(0), dy2.stride(0), dx2.stride(0)),
               (block, next_pow2(n_slices, 16), needs_dx, True, *mode), num_warps,
               cooperative=True)
    else:
        chunk, num_warps = OPTIONS.loop_chunk_bwd, LOOP.bwd_warps
        per_sm = LOOP.bwd_programs_per_sm
        if config:
            chunk = config.get("chunk", chunk)
            num_warps = config.get("num_warps", num_warps)
            per_sm = config.get("programs_per_sm", per_sm)
        chunk = min(chunk, next_pow2(n_cols, 16))
        n_slices = cdiv(n_cols, chunk)
        n_groups = min(n_rows, max(1, _n_programs(x, per_sm) // n_slices))
        dot_part = torch.empty((n_rows, n_slices), dtype=torch.float32, device=x.device)
        dw_part = torch.empty((n_groups, n_cols), dtype=torch.float32, device=x.device)
        launch(_k.bwd_slices_kernel, (n_slices, n_groups, 1),
               (x2, w, dy2, rstd, dot_part, dw_part, n_rows, n_cols, x2.stride(0),
                dy2.stride(0)),
               (chunk, needs_dx, needs_dw, *mode), num_warps)
        if needs_dx:
            launch(_k.bwd_dx_looped_kernel, (n_rows, n_slices, 1),
                   (x2, w, dy2, rstd, dot_part, dx2, n_rows, n_cols, n_slices,
                    x2.stride(0), dy2.stride(0), dx2.stride(0)),
                   (chunk, next_pow2(n_slices, 16), *mode), num_warps)
    return _sum_partials(dw_part, w, traceable) if needs_dw else None


# ============================================================================
# The eager autograd.Functions
# ============================================================================


def _check_kernel_out(out_dtype) -> None:
    if out_dtype is not None and out_dtype not in KERNEL_DTYPES:
        check_out_dtype(out_dtype, kernel=True)  # raises, naming it


def _kernel_mode(x, weight, casting_mode, offset, out_dtype):
    """(llama, offset, out_dtype) of a kernel call, checked; the default mode costs one
    comparison."""
    if casting_mode == "none" and offset == 0.0 and type(offset) is float:
        llama = False
    else:
        llama, offset = check_mode(casting_mode, offset, weight)
    if out_dtype is None:
        if llama and weight is not None and weight.dtype != x.dtype:
            out_dtype = default_out_dtype(x, weight, llama)
    else:
        _check_kernel_out(out_dtype)
    return llama, offset, out_dtype


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm with Triton forward and backward kernels.

    ``RMSNormFunction.apply(x, weight, eps=1e-5, out_dtype=None, casting_mode="none",
    offset=0.0)`` runs on any tensor Triton takes: CUDA, or CPU when ``TRITON_INTERPRET=1``
    was set before Triton was imported; ``weight`` may be None. The forward saves x,
    weight and one float32 rstd per row; the backward recomputes x_hat from them. y has
    ``out_dtype`` (default as ``rms_norm`` says), dx x's dtype, dweight the weight's.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight, eps: float = 1e-5,
                out_dtype: Optional[torch.dtype] = None,  # noqa: UP045
                casting_mode: str = "none", offset: float = 0.0) -> torch.Tensor:
        if _k is None:
            raise triton_unavailable_error()
        eps = kernel_eps(x, weight, eps)
        llama, offset, out_dtype = _kernel_mode(x, weight, casting_mode, offset, out_dtype)
        # No input needs a gradient: no backward will run, so skip rstd.
        need_rstd = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        y, rstd = rms_norm_fwd(x, weight, eps, need_rstd=need_rstd, out_dtype=out_dtype,
                               offset=offset, llama=llama)
        if need_rstd:
            ctx.save_for_backward(x, weight, rstd)
            ctx.mode = (offset, llama)
        return y

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        offset, llama = ctx.mode
        dx, dw = rms_norm_bwd(grad_output, x, weight, rstd, needs_dx=need_x, needs_dw=need_w,
                              offset=offset, llama=llama)
        return dx, dw, None, None, None, None


class FusedAddRMSNormFunction(torch.autograd.Function):
    """``(y, s)`` with ``s = x + residual`` (in x's dtype) and ``y = RMSNorm(s) * weight``,
    one Triton kernel each way.

    ``FusedAddRMSNormFunction.apply(x, residual, weight, eps=1e-5, out_dtype=None,
    casting_mode="none", offset=0.0)``. The forward reads x and residual once and writes
    s and y; it saves s, weight and rstd. The backward reads dy, ds (the gradient reaching
    s directly, when s was used) and s once, and writes one gradient shared by x and
    residual (plus a copy in the residual's dtype when that differs from x's) and dweight.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, residual: torch.Tensor, weight, eps: float = 1e-5,
                out_dtype: Optional[torch.dtype] = None,  # noqa: UP045
                casting_mode: str = "none", offset: float = 0.0):
        if _k is None:
            raise triton_unavailable_error()
        eps = kernel_eps(x, weight, eps)
        # Checked before any launch: the kernels would read an int32 residual as bits.
        if not (isinstance(residual, torch.Tensor) and residual.dtype in KERNEL_DTYPES
                and residual.shape == x.shape and residual.device == x.device):
            check_residual(x, residual, kernel=True)
        llama, offset, out_dtype = _kernel_mode(x, weight, casting_mode, offset, out_dtype)
        y, s, rstd = fused_add_rms_norm_fwd(x, residual, weight, eps, out_dtype=out_dtype,
                                            offset=offset, llama=llama)
        ctx.residual_dtype = residual.dtype
        ctx.mode = (offset, llama)
        ctx.save_for_backward(s, weight, rstd)
        # An unused output's gradient comes as None rather than a tensor of zeros made
        # for it (an allocation and a fill): the last norm of a model uses y alone.
        ctx.set_materialize_grads(False)
        return y, s

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor | None, grad_sum: torch.Tensor | None):
        none4 = (None, None, None, None)
        if grad_y is None:  # only the sum was used: it passes its gradient on unchanged
            if grad_sum is None:
                return None, None, None, *none4
            return grad_sum, grad_sum.to(ctx.residual_dtype), None, *none4
        s, weight, rstd = ctx.saved_tensors
        offset, llama = ctx.mode
        dx, dr, dw = fused_add_rms_norm_bwd(
            grad_y, grad_sum, s, weight, rstd, ctx.residual_dtype,
            needs_dw=ctx.needs_input_grad[2], offset=offset, llama=llama)
        return dx, dr, dw, *none4


# ============================================================================
# The operators for torch.compile
# ============================================================================

HAS_TRITON_OP = hasattr(torch.library, "triton_op") and hasattr(torch.library, "wrap_triton")
HAS_LIBRARY_OPS = HAS_TRITON and (HAS_TRITON_OP or (hasattr(torch.library, "custom_op")
                                                    and hasattr(torch.library,
                                                                "register_autograd")))


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] != 0 else 0


def _empty_to_none(t: torch.Tensor, wanted: bool):
    return t if wanted else None


if HAS_LIBRARY_OPS:
    _op = torch.library.triton_op if HAS_TRITON_OP else torch.library.custom_op
    # Optional[...] rather than "| None" below: the schema is inferred from these.

    @_op("tritonnorm::rms_norm_fwd", mutates_args=())
    def rms_norm_fwd_op(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float,  # noqa: UP045
                        out_dtype: Optional[torch.dtype] = None,  # noqa: UP045
                        offset: float = 0.0, llama: bool = False,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """(y, rstd); arguments checked by the caller."""
        return rms_norm_fwd(x, weight, eps, traceable=HAS_TRITON_OP, out_dtype=out_dtype,
                            offset=offset, llama=llama)

    @_op("tritonnorm::rms_norm_bwd", mutates_args=())
    def rms_norm_bwd_op(grad_output: torch.Tensor, x: torch.Tensor,
                        weight: Optional[torch.Tensor],  # noqa: UP045
                        rstd: torch.Tensor, needs_dx: bool, needs_dw: bool,
                        offset: float = 0.0, llama: bool = False,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """(dx, dweight); one not asked for comes back empty (an op returns no None)."""
        dx, dw = rms_norm_bwd(grad_output, x, weight, rstd, needs_dx=needs_dx,
                              needs_dw=needs_dw, traceable=HAS_TRITON_OP, offset=offset,
                              llama=llama)
        return (x.new_empty((0,)) if dx is None else dx,
                x.new_empty((0,)) if dw is None else dw)

    @_op("tritonnorm::fused_add_rms_norm_fwd", mutates_args=())
    def fused_add_rms_norm_fwd_op(
        x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor],  # noqa: UP045
        eps: float, out_dtype: Optional[torch.dtype] = None,  # noqa: UP045
        offset: float = 0.0, llama: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(y, x + residual, rstd); arguments checked by the caller."""
        return fused_add_rms_norm_fwd(x, residual, weight, eps, traceable=HAS_TRITON_OP,
                                      out_dtype=out_dtype, offset=offset, llama=llama)

    @_op("tritonnorm::fused_add_rms_norm_bwd", mutates_args=())
    def fused_add_rms_norm_bwd_op(
        grad_y: torch.Tensor, grad_sum: torch.Tensor, s: torch.Tensor,
        weight: Optional[torch.Tensor],  # noqa: UP045
        rstd: torch.Tensor, residual_dtype: torch.dtype, needs_dw: bool,
        offset: float = 0.0, llama: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dx, dresidual, dweight). An op's outputs may not alias each other, so when the
        residual has x's dtype (one gradient serves both) dresidual comes back empty."""
        dx, dr, dw = fused_add_rms_norm_bwd(grad_y, grad_sum, s, weight, rstd,
                                            residual_dtype, needs_dw=needs_dw,
                                            traceable=HAS_TRITON_OP, offset=offset,
                                            llama=llama)
        return (dx, s.new_empty((0,)) if dr is dx else dr,
                s.new_empty((0,)) if dw is None else dw)

    if not HAS_TRITON_OP:  # a custom op needs its shapes spelled out for tracing

        def _dw_like(weight, needs_dw, x):
            return torch.empty_like(weight) if needs_dw else x.new_empty((0,))

        @rms_norm_fwd_op.register_fake
        def _(x, weight, eps, out_dtype=None, offset=0.0, llama=False):
            y = torch.empty_like(x, memory_format=torch.contiguous_format, dtype=out_dtype)
            return y, x.new_empty((_rows(x),), dtype=torch.float32)

        @rms_norm_bwd_op.register_fake
        def _(grad_output, x, weight, rstd, needs_dx, needs_dw, offset=0.0, llama=False):
            dx = (torch.empty_like(x, memory_format=torch.contiguous_format) if needs_dx
                  else x.new_empty((0,)))
            return dx, _dw_like(weight, needs_dw and weight is not None, x)

        @fused_add_rms_norm_fwd_op.register_fake
        def _(x, residual, weight, eps, out_dtype=None, offset=0.0, llama=False):
            y = torch.empty_like(x, memory_format=torch.contiguous_format, dtype=out_dtype)
            s = torch.empty_like(x, memory_format=torch.contiguous_format)
            return y, s, x.new_empty((_rows(x),), dtype=torch.float32)

        @fused_add_rms_norm_bwd_op.register_fake
        def _(grad_y, grad_sum, s, weight, rstd, residual_dtype, needs_dw, offset=0.0,
              llama=False):
            dx = torch.empty_like(s, memory_format=torch.contiguous_format)
            dr = (s.new_empty((0,)) if residual_dtype == s.dtype
                  else torch.empty_like(dx, dtype=residual_dtype))
            return dx, dr, _dw_like(weight, needs_dw and weight is not None, s)

    def _rms_setup(ctx, inputs, output):
        x, weight = inputs[:2]
        ctx.mode = (inputs[4], inputs[5]) if len(inputs) > 5 else (0.0, False)
        ctx.save_for_backward(x, weight, output[1])

    def _rms_backward(ctx, grad_y, _grad_rstd):
        x, weight, rstd = ctx.saved_tensors
        need_x = ctx.needs_input_grad[0]
        need_w = ctx.needs_input_grad[1] and weight is not None
        dx, dw = rms_norm_bwd_op(grad_y, x, weight, rstd, need_x, need_w, *ctx.mode)
        return _empty_to_none(dx, need_x), _empty_to_none(dw, need_w), None, None, None, None

    torch.library.register_autograd("tritonnorm::rms_norm_fwd", _rms_backward,
                                    setup_context=_rms_setup)

    def _add_setup(ctx, inputs, output):
        residual, weight = inputs[1:3]
        ctx.residual_dtype = residual.dtype
        ctx.mode = (inputs[5], inputs[6]) if len(inputs) > 6 else (0.0, False)
        ctx.save_for_backward(output[1], weight, output[2])

    def _add_backward(ctx, grad_y, grad_sum, _grad_rstd):
        s, weight, rstd = ctx.saved_tensors
        if grad_y is None:
            grad_y = torch.zeros_like(s)
        if grad_sum is None:
            grad_sum = torch.zeros_like(s)
        need_w = ctx.needs_input_grad[2] and weight is not None
        dx, dr, dw = fused_add_rms_norm_bwd_op(grad_y, grad_sum, s, weight, rstd,
                                               ctx.residual_dtype, need_w, *ctx.mode)
        dr = dx if ctx.residual_dtype == s.dtype else dr
        return dx, dr, _empty_to_none(dw, need_w), None, None, None, None

    torch.library.register_autograd("tritonnorm::fused_add_rms_norm_fwd", _add_backward,
                                    setup_context=_add_setup)


# ============================================================================
# The entry points
# ============================================================================


def triton_unavailable_error() -> ImportError:
    """The error to raise when the Triton kernels are asked for but cannot be imported."""
    hint = ("install numpy too (pip install 'tritonnorm[interpret]'): Triton's interpreter "
            "needs it" if "numpy" in str(TRITON_IMPORT_ERROR) else
            "install triton (it comes with torch on Linux)")
    return ImportError(f"tritonnorm's Triton kernels cannot be imported "
                       f"({TRITON_IMPORT_ERROR}); {hint}")


def _pick_is_compiling():
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling"):
        return compiler.is_compiling
    return torch._dynamo.is_compiling  # pragma: no cover - PyTorch < 2.3


# Looked up once: the check runs on every call.
_is_compiling = _pick_is_compiling()
_F_RMS_NORM = getattr(torch.nn.functional, "rms_norm", None)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


#: PyTorch >= 2.9 runs ``F.rms_norm`` on CUDA as one fused kernel each way.
HAS_FUSED_TORCH = _F_RMS_NORM is not None and _torch_version() >= (2, 9)


def _use_kernels(x, weight) -> bool:
    return (HAS_TRITON and isinstance(x, torch.Tensor)
            and (x.is_cuda or (_INTERPRET and OPTIONS.interpret_cpu))
            and x.dtype in KERNEL_DTYPES
            and (weight is None or (isinstance(weight, torch.Tensor)
                                    and weight.dtype in KERNEL_DTYPES)))


def _via_op() -> bool:
    """Under torch.compile (or when asked), go through the registered operators."""
    return HAS_LIBRARY_OPS and (_is_compiling() or OPTIONS.eager_op)


def _small(x: torch.Tensor) -> bool:
    """Whether x has fewer elements than ``OPTIONS.torch_below`` names for its dtype: a
    call too small for the kernels' device-time advantage to repay their host cost."""
    below = OPTIONS.torch_below.get(str(x.dtype), 0)
    return below > 0 and x.numel() < below  # no size guard under torch.compile at 0


def _to_inductor(x: torch.Tensor, fused_add: bool) -> bool:
    """Whether a call traced by torch.compile takes the plain formula
    (``OPTIONS.compiled_dispatch``)."""
    if not _is_compiling():  # OPTIONS.eager_op: the operators, eagerly
        return False
    choice = OPTIONS.compiled_dispatch
    if choice not in ("auto", "kernels", "inductor"):
        raise ValueError(f"OPTIONS.compiled_dispatch must be 'auto', 'kernels' or "
                         f"'inductor', got {choice!r}")
    return choice == "inductor" or (choice == "auto" and (not fused_add or _small(x)))


def _prefer_torch(x: torch.Tensor) -> bool:
    """Whether an eager call on CUDA takes PyTorch's ``F.rms_norm`` (``OPTIONS.eager_dispatch``)."""
    choice = OPTIONS.eager_dispatch
    if choice == "kernels" or _F_RMS_NORM is None:
        return False
    if choice == "torch":
        return True
    if choice != "auto":
        raise ValueError(f"OPTIONS.eager_dispatch must be 'auto', 'kernels' or 'torch', "
                         f"got {choice!r}")
    return HAS_FUSED_TORCH and _small(x)


def torch_rms_norm(x: torch.Tensor, weight, eps: float, out_dtype, llama: bool,
                   offset: float) -> torch.Tensor:
    """RMSNorm through PyTorch's ``F.rms_norm`` with tritonnorm's casting semantics
    (arguments checked): "llama" normalises in x's dtype without a weight (x_hat rounded
    once), then multiplies; "none"/"gemma" normalise in float32 with the float32 gain and
    round once. Differentiable by autograd (PyTorch's own backward)."""
    hidden = (x.shape[-1],)
    if llama:
        y = _F_RMS_NORM(x, hidden, None, eps)
        if weight is not None:
            y = y * (weight.float() + offset if offset else weight)
    else:
        g = None if weight is None else (weight.float() + offset if offset else weight.float())
        y = _F_RMS_NORM(x.float(), hidden, g, eps)
    out = out_dtype or default_out_dtype(x, weight, llama)
    return y if y.dtype == out else y.to(out)


def _entry_mode(casting_mode: str, offset: float, weight, out_dtype) -> tuple[bool, float]:
    """(llama, offset) of a public call in a mode other than the default, its mode and
    out_dtype checked. The entry points test for the default inline: it is every call of
    a model that names no mode, on the host-time hot path."""
    if out_dtype is not None and out_dtype not in KERNEL_DTYPES:
        check_out_dtype(out_dtype)
    return check_mode(casting_mode, offset, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-5, *,
             out_dtype: torch.dtype | None = None, casting_mode: str = "none",
             offset: float = 0.0) -> torch.Tensor:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x**2, -1) + eps) * (offset + weight)``.

    CUDA tensors in float32/float16/bfloat16 run the Triton kernels, or, for eager calls
    small enough to be host-bound, PyTorch's fused ``F.rms_norm`` with the same casting
    semantics (``OPTIONS.eager_dispatch``, ``OPTIONS.torch_below``); anything else runs
    ``RMSNormTorchFunction``. Under ``torch.compile`` the kernels run as
    ``torch.ops.tritonnorm.rms_norm_fwd``, which Inductor launches itself
    (``fullgraph=True`` and ``mode="reduce-overhead"`` work). Where no gradient can flow
    the forward kernel runs alone, without writing the per-row statistic.

    The casting modes, with x_hat = x * rsqrt(mean(x**2) + eps) and g = offset + weight:

    * ``"none"`` (the default): x, weight and offset in float32, y = x_hat * g in float32,
      rounded once to ``out_dtype`` (default x's dtype);
    * ``"gemma"``: the same arithmetic, which is Hugging Face's GemmaRMSNorm
      (``(x_hat * (1.0 + weight.float())).type_as(x)``, with ``offset=1.0``);
    * ``"llama"``: x_hat is rounded to x's dtype first, then multiplied by g (in float32)
      and rounded to ``out_dtype`` (default x's dtype promoted with the weight's):
      Hugging Face's LlamaRMSNorm (``weight * x_hat.to(input_dtype)``).

    The gradients take the rounding as the identity (as autograd takes a cast); the
    weight's gradient is the sum of dy times what the weight multiplied (the rounded
    x_hat in "llama" mode), accumulated in float32; the offset does not change it.

    Args:
        x: input of shape (*, H); any layout whose leading dims collapse to rows without a
            copy (a contiguous (batch, seq, heads, head_dim) per-head tensor does) reaches
            the kernels as it is.
        weight: gain of shape (H,), or None (no scale); may be float32 while x is half
            precision.
        eps: added to the mean square before the square root.
        out_dtype: y's dtype (see the modes). Under autocast, the autocast dtype saves the
            cast the next layer would make (one kernel and a pass over y each way).
        casting_mode: ``"none"``, ``"gemma"`` or ``"llama"``.
        offset: 0.0 or 1.0, added to the weight in float32 (Gemma's ``1 + weight``).

    Returns:
        y with x's shape.

    Raises:
        ValueError: weight is not of shape (H,), x and weight are on different devices, an
            unknown casting mode, an offset other than 0.0 and 1.0 (or one without a weight).
        TypeError: a non-floating dtype (out_dtype included), or an eps that is no number.
    """
    if (casting_mode == "none" and offset == 0.0 and type(offset) is float
            and (out_dtype is None or out_dtype in KERNEL_DTYPES)):
        llama = False
    else:
        llama, offset = _entry_mode(casting_mode, offset, weight, out_dtype)
    if not _use_kernels(x, weight) or not (out_dtype is None or out_dtype in KERNEL_DTYPES):
        return RMSNormTorchFunction.apply(x, weight, eps, out_dtype, casting_mode, offset)
    if out_dtype is None and llama and weight is not None and weight.dtype != x.dtype:
        out_dtype = default_out_dtype(x, weight, llama)
    if _via_op():
        if _to_inductor(x, fused_add=False):
            return rms_norm_reference(x, weight, eps, casting_mode=casting_mode,
                                      offset=offset, out_dtype=out_dtype)
        check_rms_norm_args(x, weight, kernel=True)
        return rms_norm_fwd_op(x, weight, check_eps(eps), out_dtype, offset, llama)[0]
    if _prefer_torch(x):
        return torch_rms_norm(x, weight, kernel_eps(x, weight, eps), out_dtype, llama, offset)
    if not (torch.is_grad_enabled()
            and (x.requires_grad or (weight is not None and weight.requires_grad))):
        # Inference: nothing to record for autograd, and no rstd for a backward.
        return rms_norm_fwd(x, weight, kernel_eps(x, weight, eps), need_rstd=False,
                            out_dtype=out_dtype, offset=offset, llama=llama)[0]
    return RMSNormFunction.apply(x, weight, eps, out_dtype, casting_mode, offset)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-5,
    *, out_dtype: torch.dtype | None = None, casting_mode: str = "none", offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual, weight, eps, ...), x + residual)`` in one pass each way.

    The pre-norm Transformer's ``h = h + branch(...)`` then ``norm(h)``: on CUDA one
    Triton kernel reads x and residual once and writes the sum and the normalised sum,
    and one backward kernel reads the two incoming gradients and the sum once. This
    saves a full read and write of the residual stream at every norm. New tensors are
    returned; the inputs are never modified (which torch.compile and CUDA graphs need).

    The sum is rounded to **x's dtype** (pass the residual stream as ``x`` when it is
    float32 and the branch output half precision), and y is computed from the rounded
    sum, exactly as ``rms_norm((x + residual).to(x.dtype), weight, ...)`` would.

    Args:
        x: input of shape (*, H); the sum takes its dtype.
        residual: what to add to x: x's shape and device, any floating dtype the kernels
            take.
        weight: gain of shape (H,), or None.
        eps: added to the mean square before the square root.
        out_dtype, casting_mode, offset: as ``rms_norm``.

    Returns:
        (y, x + residual) with x's shape; the sum in x's dtype, y in ``out_dtype``.

    Raises:
        ValueError: residual's shape or device differs from x's, or as ``rms_norm``.
        TypeError: a non-floating dtype (residual's and out_dtype included).
    """
    if (casting_mode == "none" and offset == 0.0 and type(offset) is float
            and (out_dtype is None or out_dtype in KERNEL_DTYPES)):
        llama = False
    else:
        llama, offset = _entry_mode(casting_mode, offset, weight, out_dtype)
    if not (_use_kernels(x, weight) and isinstance(residual, torch.Tensor)
            and residual.dtype in KERNEL_DTYPES
            and (out_dtype is None or out_dtype in KERNEL_DTYPES)):
        check_rms_norm_args(x, weight)
        check_residual(x, residual)
        s = (x + residual).to(x.dtype)
        y = RMSNormTorchFunction.apply(s, weight, eps, out_dtype, casting_mode, offset)
        return y, s
    if out_dtype is None and llama and weight is not None and weight.dtype != x.dtype:
        out_dtype = default_out_dtype(x, weight, llama)
    # A residual of another shape or device is refused by the launcher, before any work.
    if _via_op():
        check_rms_norm_args(x, weight, kernel=True)
        check_residual(x, residual, kernel=True)
        if _to_inductor(x, fused_add=True):
            s = (x + residual).to(x.dtype)
            return rms_norm_reference(s, weight, eps, casting_mode=casting_mode,
                                      offset=offset, out_dtype=out_dtype), s
        y, s, _ = fused_add_rms_norm_fwd_op(x, residual, weight, check_eps(eps), out_dtype,
                                            offset, llama)
        return y, s
    if _prefer_torch(x):
        eps = kernel_eps(x, weight, eps)
        check_residual(x, residual, kernel=True)
        s = x + residual
        if s.dtype != x.dtype:  # a no-op .to() still costs a dispatcher call, ~1.5 µs
            s = s.to(x.dtype)
        return torch_rms_norm(s, weight, eps, out_dtype, llama, offset), s
    if not (torch.is_grad_enabled()
            and (x.requires_grad or residual.requires_grad
                 or (weight is not None and weight.requires_grad))):
        check_residual(x, residual, kernel=True)
        y, s, _ = fused_add_rms_norm_fwd(x, residual, weight, kernel_eps(x, weight, eps),
                                         need_rstd=False, out_dtype=out_dtype, offset=offset,
                                         llama=llama)
        return y, s
    return FusedAddRMSNormFunction.apply(x, residual, weight, eps, out_dtype, casting_mode,
                                         offset)
