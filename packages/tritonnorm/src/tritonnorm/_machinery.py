"""The launch machinery: what cuts the host time of an eager call on the kernels.

A ``kernel[grid](...)`` call costs tens of µs of host time, which is the whole cost of a
small norm. Four pieces cut it; ``_host`` reaches them only through the calls named below,
and ``OPTIONS.launch_machinery = False`` switches all of them off:

* the direct launcher (``launch``): Triton's compiled kernel, kept per specialisation and
  launched through ``CompiledKernel.run`` with bare addresses;
* recorded launch plans (``replay_forward``, ``record_forward``, ``replay_backward``,
  ``backward_key``): a contiguous shape launched before is launched again from a ``Plan``
  with its addresses, one alignment test and the direct launcher;
* scratch memory per (device, stream) (``partials_buffer``);
* the weight-gradient sum folded into the backward kernel (``folded_backward``), which
  saves a launch.

Measured inside models: docs/benchmarks/README.md, "launch machinery".
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

import tritonnorm._launch as _launch
import tritonnorm._tuning as _tuning
from tritonnorm._launch import kernels as _k
from tritonnorm._tuning import cdiv, next_pow2
from tritonnorm.options import _Switches


def _triton_version() -> tuple[int, int]:
    try:
        import triton

        major, minor = triton.__version__.split(".")[:2]
        return int(major), int(minor)
    except (ImportError, ValueError, AttributeError):  # pragma: no cover - odd installs
        return (0, 0)


@dataclass
class Machinery(_Switches):
    """Each piece of the machinery on its own (for benchmarks; ``OPTIONS.launch_machinery``
    switches them all)."""

    direct_launch: bool = _triton_version() >= (3, 4) and not _tuning.INTERPRET
    """Needs Triton >= 3.4, whose launcher takes every argument in signature order. Turned
    off for good if the launcher is not the one we know."""
    launch_plans: bool = True
    """Needs ``direct_launch``."""
    fold_dw_sum: bool = True
    """Only in cooperative launches (or the interpreter)."""


SWITCHES = Machinery()

# ============================================================================ direct launcher

_COMPILED: dict = {}
_MAX_COMPILED = 4096


def _arg_key(a):
    """What Triton specialises an argument on."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, bool):
        return bool, a
    if isinstance(a, int):
        return a == 1, a % 16 == 0, -0x80000000 <= a <= 0x7FFFFFFF
    return type(a)


def _direct_args(args: tuple) -> tuple[tuple, list]:
    """(cache key of ``args``, ``args`` with each tensor replaced by its address): given
    addresses, the launcher skips its per-pointer driver query (the callers put every
    tensor on the launch's device)."""
    key, out = [], []
    for a in args:
        if isinstance(a, torch.Tensor):
            ptr = a.data_ptr()  # _arg_key's key, without a second call
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
# ``compiled[grid](...)`` calls. Calling it directly is right only while no launch hook (a
# profiler's) is registered; otherwise the full path runs.
_HOOKS = _launch_hooks() if _triton_version() >= (3, 6) else None


def _hooks_idle() -> bool:
    return _HOOKS is not None and not (_HOOKS[0].calls or _HOOKS[1].calls)


def current_stream(device_index: int) -> int:
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream  # pragma: no cover


def launch(kernel, grid: tuple[int, int, int], args: tuple, consts: tuple, num_warps: int,
           cooperative: bool = False):
    """``_launch.jit``'s launch through the compiled kernel kept for this specialisation;
    returns that compiled kernel (for a plan), or None on a launch that compiled it."""
    cooperative = cooperative and _launch.COOPERATIVE
    if not SWITCHES.direct_launch:
        _launch.jit(kernel, grid, args, consts, num_warps, cooperative)
        return None
    # id() of the kernel (a module global); the first tensor's device and the raw current
    # stream, which Triton itself would read.
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
            SWITCHES.direct_launch = False
            _COMPILED.clear()
            _launch.jit(kernel, grid, args, consts, num_warps, cooperative)
            return None
    # The first launch compiles through the JIT on the tensors' device, where the direct
    # path later launches it.
    with torch.cuda.device(device):
        compiled = kernel[grid](*args, *consts, **_launch.jit_options(num_warps, cooperative))
    if compiled is None or not hasattr(compiled, "function"):
        SWITCHES.direct_launch = False  # not the Triton we know: always the JIT from now on
        return None
    if len(_COMPILED) >= _MAX_COMPILED:
        _COMPILED.clear()
    _COMPILED[key] = compiled
    return None


# ============================================================================ launch plans

#: The pointer arguments a replay fills in, in the kernel's order (a prefix of its
#: ``_launch`` Args; checked when a plan is recorded and by the signature test).
FWD_ROWS_POINTERS = ("X", "R", "W", "Y", "S", "RSTD")
FWD_REREAD_POINTERS = ("X", "W", "Y", "RSTD")
BWD_ROWS_POINTERS = ("X", "W", "DY", "RSTD", "DX", "DW_PART", "DS", "DR", "DW", "COUNTER")


class Plan(NamedTuple):
    """A recorded launch: everything but the addresses."""

    kernel: Any
    """The ``@triton.jit`` function launched (which tells the pointers' order)."""
    compiled: Any
    """Triton's compiled kernel, as ``launch`` returned it."""
    grid: tuple[int, int, int]
    tail: tuple
    """The scalar and constexpr arguments after the pointers."""
    rstd_like: Any = None
    """The forward's: a tensor the replay allocates rstd like (None: no rstd)."""


class LaunchCache:
    """Plans by a key of what fixes the grid and the scalar arguments (shapes, dtypes,
    devices, flags). Only launches whose tensors were all 16-byte aligned are recorded; a
    call whose tensors are not takes the full path."""

    def __init__(self) -> None:
        self._plans: dict = {}

    def get(self, key) -> Plan | None:
        """The plan recorded for ``key``; None where there is none or plans cannot be used
        now (switched off, a launch hook registered, a forced configuration)."""
        if (not (SWITCHES.launch_plans and SWITCHES.direct_launch) or not _hooks_idle()
                or _tuning.OVERRIDES):
            return None
        return self._plans.get(key)

    def record(self, key, compiled, kernel, grid: tuple, args: tuple, consts: tuple,
               pointers: tuple[str, ...], rstd_like=None) -> None:
        """Remember a launch that just ran, whose first arguments are ``pointers``."""
        n = len(pointers)
        if args._fields[:n] != pointers:
            raise RuntimeError(f"{kernel}: pointer arguments {args._fields[:n]}, not {pointers}")
        if (compiled is None or _tuning.overridden()
                or any(a.data_ptr() & 15 for a in args[:n])):
            return
        if len(self._plans) >= _MAX_COMPILED:
            self._plans.clear()
        self._plans[key] = Plan(kernel, compiled, grid, (*args[n:], *consts), rstd_like)


def _replay(plan: Plan, stream: int, ptrs: tuple) -> bool:
    """Launch ``plan`` on the raw CUDA ``stream`` with these addresses; False, launching
    nothing, when one is not 16-byte aligned."""
    align = 0
    for p in ptrs:
        align |= p
    if align & 15:
        return False
    compiled, grid = plan.compiled, plan.grid
    compiled.run(grid[0], grid[1], grid[2], stream, compiled.function,
                 compiled.packed_metadata, None, None, None, *ptrs, *plan.tail)
    return True


_FWD_PLANS = LaunchCache()
_BWD_PLANS = LaunchCache()


def _all_contiguous(*tensors) -> bool:
    for t in tensors:  # noqa: SIM110 - a generator in all() costs more on this hot path
        if t is not None and not t.is_contiguous():
            return False
    return True


def _fwd_key(x, residual, weight, need_rstd, eps, out_dtype, mode) -> tuple:
    """What fixes an eager rows forward on contiguous tensors. The devices are in it
    because a replay takes bare addresses: a call whose tensors do not share a device
    finds no plan."""
    r = x if residual is None else residual
    w = x if weight is None else weight
    return (x.shape, r.shape, w.shape, x.dtype, r.dtype, w.dtype, x.get_device(),
            r.get_device(), w.get_device(), residual is None, need_rstd, eps, out_dtype, mode)


def replay_forward(x, residual, weight, eps, need_rstd, out_dtype, mode):
    """(y, s, rstd) of an eager rows forward of a shape launched before, its outputs
    allocated in x's shape (no views); None where no plan applies."""
    if not _all_contiguous(x, residual, weight):
        return None
    plan = _FWD_PLANS.get(_fwd_key(x, residual, weight, need_rstd, eps, out_dtype, mode))
    if plan is None:
        return None
    # empty_like reads shape, dtype and device from a tensor: half new_empty's host time.
    y = torch.empty_like(x, dtype=out_dtype)
    s = None if residual is None else torch.empty_like(x)
    rstd = torch.empty_like(plan.rstd_like) if need_rstd else None
    Y = y.data_ptr()  # noqa: N806 - named as the kernels name them
    X = x.data_ptr()  # noqa: N806
    RSTD = Y if rstd is None else rstd.data_ptr()  # noqa: N806 - y stands in, unwritten
    W = X if weight is None else weight.data_ptr()  # noqa: N806 - x stands in, unread
    if plan.kernel is _k.fwd_rows_kernel:  # FWD_ROWS_POINTERS
        ptrs = (X, X if residual is None else residual.data_ptr(), W, Y,
                Y if s is None else s.data_ptr(), RSTD)
    else:  # FWD_REREAD_POINTERS
        ptrs = (X, W, Y, RSTD)
    if not _replay(plan, current_stream(x.get_device()), ptrs):
        return None
    return y, s, rstd


def record_forward(x, residual, weight, need_rstd, eps, out_dtype, mode, compiled, kernel,
                   grid, args, consts, rstd) -> None:
    """Record the rows forward that just ran (``rstd`` is kept as the template a replay
    allocates rstd like: 4 bytes a row per recorded shape)."""
    if _all_contiguous(x, residual, weight):
        pointers = FWD_ROWS_POINTERS if kernel is _k.fwd_rows_kernel else FWD_REREAD_POINTERS
        _FWD_PLANS.record(_fwd_key(x, residual, weight, need_rstd, eps, out_dtype, mode),
                          compiled, kernel, grid, args, consts, pointers, rstd)


def backward_key(grad_output, x, weight, rstd, ds, needs_dx, dr_dtype, mode) -> tuple | None:
    """What fixes an eager folded rows backward on contiguous tensors (see ``_fwd_key``);
    None where the tensors are not contiguous."""
    if not _all_contiguous(x, grad_output, ds, weight):
        return None
    d = x if ds is None else ds
    return (x.shape, grad_output.shape, d.shape, weight.shape, x.dtype, grad_output.dtype,
            d.dtype, weight.dtype, dr_dtype, x.get_device(), grad_output.get_device(),
            d.get_device(), rstd.get_device(), weight.get_device(), ds is None, needs_dx,
            SWITCHES.fold_dw_sum, mode)


def replay_backward(grad_output, x, weight, rstd, needs_dx, ds, dr_dtype, mode):
    """(dx, dr, dweight) of an eager folded rows backward of a shape launched before, as
    ``_host._backward`` returns them, allocated in x's shape; None where no plan applies."""
    key = backward_key(grad_output, x, weight, rstd, ds, needs_dx, dr_dtype, mode)
    plan = None if key is None else _BWD_PLANS.get(key)
    if plan is None:
        return None
    scratch = eager_scratch(x, plan.grid[0], x.shape[-1])
    if scratch is None:  # capturing a CUDA graph: scratch memory of its own
        return None
    stream, dw_part, counter = scratch
    dx = torch.empty_like(x) if needs_dx else x
    two_outs = dr_dtype is not None and dr_dtype != x.dtype
    dr = torch.empty_like(x, dtype=dr_dtype) if two_outs else dx
    dw = torch.empty_like(weight)
    X = x.data_ptr()  # noqa: N806
    ptrs = (X, weight.data_ptr(), grad_output.data_ptr(), rstd.data_ptr(), dx.data_ptr(),
            dw_part.data_ptr(), X if ds is None else ds.data_ptr(), dr.data_ptr(),
            dw.data_ptr(), counter.data_ptr())  # BWD_ROWS_POINTERS
    if not _replay(plan, stream, ptrs):
        return None
    if not needs_dx:
        return None, None, dw
    return dx, (None if dr_dtype is None else dr), dw


# ============================================================================ scratch memory

# The folded sum's counters: two int32 (an arrival count, zero on entry and reset by the
# last arrival, and a generation word), padded to 16 bytes, per (device, stream).
_COUNTERS: dict = {}
# Counters for launches captured into CUDA graphs: a graph may be replayed on any stream,
# so each captured launch takes a pair of its own from a pool zeroed before any capture
# (or, the pool used up or never made, one zeroed in the graph).
_COUNTER_POOLS: dict = {}
COUNTER_POOL_SIZE = 1024
# The backward's [programs, H] float32 partials live only until the sum that follows on
# the same stream: the latest shape's buffer is kept per (device, stream).
_PARTIALS: dict = {}


def _pick_capture_check():
    raw = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
    return raw if raw is not None else torch.cuda.is_current_stream_capturing


_capturing = _pick_capture_check()  # looked up once: it runs on every eager backward


def eager_stream(x: torch.Tensor) -> tuple[int, int] | None:
    """(device, current stream) of an eager launch on ``x``'s GPU; None on the CPU or
    while a CUDA graph is captured."""
    device = x.get_device()
    if device < 0 or _capturing():
        return None
    return device, current_stream(device)


def eager_scratch(x: torch.Tensor, n_prog: int, n_cols: int
                  ) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """(raw stream, partials buffer, zeroed counters) of an eager folded backward, with one
    stream query for all three; None on the CPU or while a CUDA graph is captured."""
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
    """An uninitialised float32 [n_prog, n_cols] buffer for the backward's partials."""
    key = eager_stream(x)
    if key is None:
        return x.new_empty((n_prog, n_cols), dtype=torch.float32)
    buf = _PARTIALS.get(key)
    if buf is None or buf.shape[0] != n_prog or buf.shape[1] != n_cols:
        buf = _PARTIALS[key] = x.new_empty((n_prog, n_cols), dtype=torch.float32)
    return buf


# ============================================================================ folded sum

# Launch shapes whose cooperative launch the driver refused (a GPU shared under MPS
# limits, say): they sum their partials in a second kernel from then on.
_FOLD_REFUSED: set = set()


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


def _max_summers(x: torch.Tensor) -> int:
    """How many programs may wait to sum partials: one per SM (waiters can then never hold
    every SM while a program they wait for is yet to start); one on the interpreter."""
    index = x.get_device()
    return _launch.sm_count(index) if index >= 0 else 1


def folded_backward(weight: torch.Tensor, grid: tuple[int, int, int],
                    args: _launch.BwdRowsArgs, consts: _launch.BwdRowsConsts, num_warps: int,
                    fold_tile: int, plan_key) -> torch.Tensor | None:
    """Launch ``bwd_rows_kernel`` with its weight-gradient sum folded in (its last
    programs to finish sum the partials, in a fixed order) and record it under
    ``plan_key``; return dweight, or None, launching nothing, where it cannot fold."""
    x2 = args.X
    # Programs that wait for others: on the GPU only in a cooperative launch, where the
    # driver guarantees every program resident at once.
    if not (SWITCHES.fold_dw_sum and (_launch.COOPERATIVE or not x2.is_cuda)):
        return None
    refusal_key = (x2.get_device(), num_warps, consts.BLOCK_R, consts.BLOCK_H, consts.STAGES,
                   grid[0])
    if refusal_key in _FOLD_REFUSED:
        return None
    dw = weight.new_empty((args.n_cols,))
    # Tiles of up to 32 elements per thread: every partial a summer needs loaded at once
    # where they fit.
    red_p, red_c, n_red = fold_layout(args.n_cols, grid[0], _max_summers(x2), fold_tile)
    args = args._replace(DW=dw, COUNTER=fold_counter(x2), n_red=n_red)
    consts = consts._replace(FOLD=True, RED_P=red_p, RED_C=red_c)
    try:
        compiled = launch(_k.bwd_rows_kernel, grid, args, consts, num_warps, cooperative=True)
    except RuntimeError as err:
        warnings.warn(f"tritonnorm: cooperative backward launch refused ({err}); "
                      "summing dweight in a second kernel", RuntimeWarning, stacklevel=4)
        _FOLD_REFUSED.add(refusal_key)
        return None
    if plan_key is not None:
        _BWD_PLANS.record(plan_key, compiled, _k.bwd_rows_kernel, grid, args, consts,
                          BWD_ROWS_POINTERS)
    return dw
