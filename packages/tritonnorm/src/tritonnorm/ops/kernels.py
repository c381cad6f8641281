"""Triton kernels for RMSNorm and the launchers that choose among them.

Three kinds, picked by the row length H:

* fused ("rows") kernels (here), for rows that fit one block of registers: the forward
  reads a tile of BLOCK_R rows once (or, where it measured faster, twice: the second
  read from L2) and writes y and one float32 rstd per row; the backward is a persistent
  grid (a few programs per SM) whose programs walk over row tiles, with the next tiles'
  loads in flight, write dx and keep a float32 partial weight gradient in registers,
  stored once per program into a [n_programs, H] buffer.
* cooperative kernels (``long_row_kernels``), for longer rows on the GPU: each row is split
  over a group of co-resident programs (16-32 KiB of it each, held in registers) that
  exchange partial sums through memory, so x (and dy) are read once.
* two-pass ("looped") kernels (``long_row_kernels``), for longer rows where the cooperative
  ones cannot run (the interpreter; rows longer than 16-32 KiB × SMs).

The [n_programs, H] float32 partial weight gradients are then summed over programs in a
fixed order: by the fused backward's last programs to finish, in the same launch
(``_sum_partials_tail``), or by a column-sum kernel after the others. Nothing is
accumulated with atomics (atomics only count arrivals, and the cooperative kernels use
atomic exchanges to publish a partial, summed by every reader in a fixed order), so two
runs give bitwise the same dweight and dx.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch
import triton
import triton.language as tl

from tritonnorm.ops.long_row_kernels import (
    _bwd_coop_kernel,
    _bwd_dx_looped_kernel,
    _bwd_slices_kernel,
    _fwd_coop_kernel,
    _fwd_looped_kernel,
)

# Longest power-of-two block a fused kernel takes; longer rows go to the looped kernels.
# Tests lower these to exercise the looped path on small rows.
MAX_FUSED_BLOCK_FWD = 32768
MAX_FUSED_BLOCK_BWD = 16384
# Columns per chunk in the looped forward for 2-byte dtypes (half as many for float32, so
# each chunk is 64 KiB in flight per program); the looped backward's is LOOP_CHUNK_BWD.
LOOP_CHUNK = 32768


# --------------------------------------------------------------------------- kernels


@triton.jit
def _fwd_rows_kernel(
    X, W, Y, RSTD, n_rows, n_cols, stride_x, stride_y, eps,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, STORE_RSTD: tl.constexpr,
):
    # One tile of BLOCK_R whole rows per program: one read of x, one write of y (and of
    # rstd, unless no backward will need it).
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_H)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    y = x * rstd[:, None] * w[None, :]
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    if STORE_RSTD:
        tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _nanosleep(ns: tl.constexpr):
    # Pause this warp for about ``ns`` nanoseconds (PTX nanosleep, sm_70 and later).
    return tl.inline_asm_elementwise(f"nanosleep.u32 {ns}; mov.u32 $0, 0;", "=r", [],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _sum_partials_tail(PART, OUT, COUNTER, gen, n_part, n_cols, n_red,
                       BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, SPIN_NS: tl.constexpr):
    # The end of a persistent kernel whose n_part programs have each stored one float32
    # row of PART: the last n_red programs to get here sum PART's columns into OUT (the
    # others just exit), which saves a second launch. COUNTER holds two int32: an arrival
    # count, zero on entry and reset by the last arrival, and a generation that the last
    # arrival bumps to release the other summers; ``gen`` is the generation each program
    # read when it started (nothing changes it before every program has arrived).
    #
    # Waiting is safe: the launch is cooperative (every program resident at once). Even
    # without that, a summer waits only for programs that arrive after it, all of which
    # are summers too, and n_red is at most the number of SMs, so while any is yet to
    # start, fewer than n_red waiters hold SMs and it finds a place.
    # Ordering: the CTA barrier puts every thread's stores of the partial before the one
    # thread's release (the arrival); the last arrival acquires them all and releases
    # them again with the generation, which the other summers acquire; their loads then
    # bypass L1 (.cg).
    tl.debug_barrier()
    ticket = tl.atomic_add(COUNTER, 1, sem="acq_rel", scope="gpu")
    r = ticket - (n_part - n_red)
    if r >= 0:
        if ticket == n_part - 1:
            tl.atomic_xchg(COUNTER, 0, sem="relaxed", scope="gpu")
            tl.atomic_add(COUNTER + 1, 1, sem="release", scope="gpu")
        else:
            while tl.atomic_add(COUNTER + 1, 0, sem="acquire", scope="gpu") == gen:
                if SPIN_NS > 0:  # poll gently: the programs still running need the L2
                    _nanosleep(SPIN_NS)
        tl.debug_barrier()
        # Summer r owns column blocks r, r + n_red, ...; each column adds the partials in
        # the same order every time (bitwise reproducible).
        for c0 in range(r * BLOCK_C, n_cols, n_red * BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            col_ok = cols < n_cols
            acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
            for p0 in range(0, n_part, BLOCK_P):
                p = p0 + tl.arange(0, BLOCK_P)
                acc += tl.load(PART + p.to(tl.int64)[:, None] * n_cols + cols[None, :],
                               mask=(p < n_part)[:, None] & col_ok[None, :], other=0.0,
                               cache_modifier=".cg")
            tl.store(OUT + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=col_ok)


@triton.jit
def _bwd_rows_kernel(
    X, W, DY, RSTD, DX, DW_PART, DW, COUNTER, n_rows, n_cols, stride_x, stride_dy,
    stride_dx, n_red,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, HAS_DX: tl.constexpr, HAS_DW: tl.constexpr,
    PREFETCH: tl.constexpr, ROW_SUM: tl.constexpr, STAGES: tl.constexpr,
    FOLD: tl.constexpr, RED_P: tl.constexpr, RED_C: tl.constexpr, SPIN_NS: tl.constexpr,
):
    # Persistent grid: program pid walks over row tiles pid, pid + P, ...; writes dx per
    # tile and keeps its share of dweight in float32 registers until the end. A program
    # needs loads in flight while it works on a tile, in one of two ways:
    # * STAGES > 1: Triton's loop pipeliner copies the next STAGES - 1 tiles' x, dy and
    #   rstd into shared memory asynchronously (cp.async), so the registers hold only the
    #   tile being worked on. Best for 16-bit rows, whose tiles are small: one tile in
    #   flight is too few bytes to cover the memory latency.
    # * PREFETCH (with STAGES = 1): the next tile is loaded into registers before the
    #   current one is worked on (software pipelining by hand), one tile in flight.
    # With neither (very long rows, where two tiles would not fit in registers) each tile
    # is loaded when its turn comes.
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    if FOLD:
        gen = tl.load(COUNTER + 1, volatile=True)  # see _sum_partials_tail
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < n_cols
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    # ROW_SUM folds each tile's rows into a [BLOCK_H] accumulator (fewer registers, so
    # taller tiles fit); otherwise the accumulator keeps the tile's shape (no reduction
    # across threads inside the loop).
    if ROW_SUM:
        dw_acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    else:
        dw_acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    n_tiles = tl.cdiv(n_rows, BLOCK_R)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    mask = (rows < n_rows)[:, None] & col_ok[None, :] & PREFETCH
    rows64 = rows.to(tl.int64)
    x_next = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    dy_next = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
    for tile in tl.range(pid, n_tiles, n_prog, num_stages=STAGES):
        rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        if PREFETCH:
            x = x_next.to(tl.float32)
            dy = dy_next.to(tl.float32)
            # Prefetch the next tile (fully masked past the end: no memory traffic).
            nrows = rows + n_prog * BLOCK_R
            nmask = (nrows < n_rows)[:, None] & col_ok[None, :]
            nrows64 = nrows.to(tl.int64)
            x_next = tl.load(X + nrows64[:, None] * stride_x + cols[None, :], mask=nmask,
                             other=0.0)
            dy_next = tl.load(DY + nrows64[:, None] * stride_dy + cols[None, :], mask=nmask,
                              other=0.0)
        else:
            x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask,
                        other=0.0).to(tl.float32)
            dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask,
                         other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        x_hat = x * rstd[:, None]
        if HAS_DX:
            w_dy = dy * w[None, :]
            c = tl.sum(w_dy * x_hat, axis=1) / n_cols
            dx = (w_dy - x_hat * c[:, None]) * rstd[:, None]
            tl.store(DX + rows64[:, None] * stride_dx + cols[None, :],
                     dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_DW:
            if ROW_SUM:
                dw_acc += tl.sum(dy * x_hat, axis=0)
            else:
                dw_acc += dy * x_hat
    if HAS_DW:
        if ROW_SUM:
            tl.store(DW_PART + pid * n_cols + cols, dw_acc, mask=col_ok)
        else:
            tl.store(DW_PART + pid * n_cols + cols, tl.sum(dw_acc, axis=0), mask=col_ok)
        # FOLD: the last programs to finish sum the partials into DW here (else a second
        # kernel does, _sum_partials_kernel).
        if FOLD:
            _sum_partials_tail(DW_PART, DW, COUNTER, gen, n_prog, n_cols, n_red, RED_P,
                               RED_C, SPIN_NS)


@triton.jit
def _fwd_rows_reread_kernel(
    X, W, Y, RSTD, n_rows, n_cols, stride_x, stride_y, eps,
    BLOCK_R: tl.constexpr, CHUNK: tl.constexpr, EVEN: tl.constexpr, STORE_RSTD: tl.constexpr,
):
    # As _fwd_rows_kernel, but x is read twice, CHUNK columns at a time: once for the sum
    # of squares, marked to stay in L2 (evict_last), then again (from L2, evict_first) to
    # normalise. A program holds one chunk in registers instead of its whole tile, so more
    # programs fit on an SM and more loads are in flight; where that outweighs the second
    # read (served by L2, not HBM) it is faster. torch.compile's forward works this way.
    # EVEN (CHUNK divides H and BLOCK_R the rows) drops the masks (see _FWD_MASK_FREE).
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    acc = tl.zeros([BLOCK_R, CHUNK], dtype=tl.float32)
    for start in range(0, n_cols, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        x_ptr = X + rows64[:, None] * stride_x + cols[None, :]
        if EVEN:
            x = tl.load(x_ptr, eviction_policy="evict_last")
        else:
            x = tl.load(x_ptr, mask=row_ok[:, None] & (cols < n_cols)[None, :], other=0.0,
                        eviction_policy="evict_last")
        x = x.to(tl.float32)
        acc += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=1) / n_cols + eps)
    if STORE_RSTD:
        tl.store(RSTD + rows, rstd, mask=row_ok)
    for start in range(0, n_cols, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        x_ptr = X + rows64[:, None] * stride_x + cols[None, :]
        y_ptr = Y + rows64[:, None] * stride_y + cols[None, :]
        if EVEN:
            x = tl.load(x_ptr, eviction_policy="evict_first").to(tl.float32)
            w = tl.load(W + cols, eviction_policy="evict_last").to(tl.float32)
            tl.store(y_ptr, (x * rstd[:, None] * w[None, :]).to(Y.dtype.element_ty))
        else:
            col_ok = cols < n_cols
            mask = row_ok[:, None] & col_ok[None, :]
            x = tl.load(x_ptr, mask=mask, other=0.0, eviction_policy="evict_first")
            w = tl.load(W + cols, mask=col_ok, other=0.0, eviction_policy="evict_last")
            y = x.to(tl.float32) * rstd[:, None] * w.to(tl.float32)[None, :]
            tl.store(y_ptr, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _sum_partials_kernel(
    PART, OUT, n_part, n_cols, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # dweight = column sum of the [n_part, H] float32 partials, in a fixed order (the same
    # shape always adds the same numbers in the same order: bitwise reproducible), cast
    # once to the weight's dtype in the same launch.
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < n_cols
    acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for start in range(0, n_part, BLOCK_P):
        r = start + tl.arange(0, BLOCK_P)
        m = (r < n_part)[:, None] & col_ok[None, :]
        acc += tl.load(PART + r.to(tl.int64)[:, None] * n_cols + cols[None, :], mask=m, other=0.0)
    tl.store(OUT + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=col_ok)


# --------------------------------------------------------------------------- launching
#
# A launch through ``kernel[grid](...)`` makes Triton bind the arguments, compute their
# specialisation key and look the compiled kernel up on every call: tens of microseconds
# of Python, which at small sizes is longer than the kernel. After the first launch of a
# given specialisation we keep the CompiledKernel Triton returned and launch it directly.
# Our key holds everything Triton specialises on: the kernel, the device, num_warps, the
# constexpr values, each tensor's dtype and 16-byte alignment, each int's ==1 and
# divisible-by-16 properties and whether it fits in int32. Floats (eps) are not
# specialised by Triton. Only on Triton >= 3.4, whose launcher takes every argument
# (constexprs included) in signature order; never under the interpreter.


def _triton_version() -> tuple[int, int]:
    try:
        major, minor = triton.__version__.split(".")[:2]
        return int(major), int(minor)
    except (ValueError, AttributeError):  # pragma: no cover - odd version strings
        return (0, 0)


DIRECT_LAUNCH = _triton_version() >= (3, 4) and os.environ.get("TRITON_INTERPRET") != "1"
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

    One pass does both: the key is ``_arg_key`` of every argument, and the launcher given
    plain addresses skips its per-pointer driver query (the callers allocate every tensor
    on the launch's device, or check that it is there).
    """
    key, out = [], []
    for a in args:
        if isinstance(a, torch.Tensor):
            ptr = a.data_ptr()
            key.append((a.dtype, ptr % 16 == 0))
            out.append(ptr)
        else:
            key.append(_arg_key(a))
            out.append(a)
    return tuple(key), out


def _has_cooperative_launch() -> bool:
    """Whether this Triton can make a CUDA cooperative launch (``launch_cooperative_grid``)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - a Triton without the NVIDIA backend
        return False
    return "launch_cooperative_grid" in getattr(CUDAOptions, "__dataclass_fields__", {})


# Launch the cooperative kernels (whose programs wait for each other) as CUDA cooperative
# launches: the driver then guarantees that every program of the grid is resident at once,
# or refuses the launch, instead of relying on nothing else holding the SMs.
COOPERATIVE_LAUNCH = _has_cooperative_launch()


def _launch_hooks():
    """Triton's launch hook chains (enter, exit), or None where this Triton has none."""
    try:
        from triton import knobs
        return knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    except (ImportError, AttributeError):  # pragma: no cover - an older Triton
        return None


# Triton >= 3.6 (checked on 3.6 and 3.9): ``CompiledKernel.run(gx, gy, gz, stream,
# function, packed_metadata, launch_metadata, enter_hook, exit_hook, *args)`` is what its
# ``compiled[grid](...)`` calls after building a closure and launch metadata. Calling it
# directly saves a few microseconds per launch when no launch hook is registered (a
# profiler such as Proton registers one; then the full path runs).
_HOOKS = _launch_hooks() if _triton_version() >= (3, 6) else None


def _hooks_idle() -> bool:
    return _HOOKS is not None and not (_HOOKS[0].calls or _HOOKS[1].calls)


def _launch_options(num_warps: int, cooperative: bool) -> dict:
    """The JIT launch options: ``num_warps``, plus a cooperative launch when asked."""
    if cooperative:
        return {"num_warps": num_warps, "launch_cooperative_grid": True}
    return {"num_warps": num_warps}


def _launch(kernel, grid: tuple[int, int, int], args: tuple, consts: tuple, num_warps: int,
            cooperative: bool = False):
    """Launch ``kernel`` over ``grid`` with runtime ``args`` then constexpr ``consts``.

    Every kernel in this module takes its runtime arguments first and its constexprs
    last, so ``args + consts`` is the full positional signature. ``cooperative`` asks for
    a CUDA cooperative launch where Triton offers one (``COOPERATIVE_LAUNCH``).
    """
    global DIRECT_LAUNCH
    cooperative = cooperative and COOPERATIVE_LAUNCH
    if not DIRECT_LAUNCH:
        kernel[grid](*args, *consts, **_launch_options(num_warps, cooperative))
        return
    # Host time is the whole cost of a small launch, so the hot path avoids what is slow
    # there: hashing the JITFunction (id() instead: kernels are module globals that live
    # as long as the process), torch.cuda.current_device() and Triton's own stream lookup
    # (the first tensor's device and the raw current stream, which is what Triton reads),
    # and, without launch hooks, Triton's launch closure and per-pointer driver queries.
    device = args[0].get_device()
    spec, direct = _direct_args(args)
    key = (id(kernel), device, num_warps, cooperative, consts, spec)
    compiled = _COMPILED.get(key)
    if compiled is not None:
        stream = _current_stream(device)
        try:
            if _hooks_idle():
                compiled.run(grid[0], grid[1], grid[2], stream, compiled.function,
                             compiled.packed_metadata, None, None, None, *direct, *consts)
            else:
                compiled[grid](*args, *consts, stream=stream)
            return
        except (TypeError, SystemError, AttributeError):  # pragma: no cover - another Triton
            DIRECT_LAUNCH = False
            _COMPILED.clear()
            kernel[grid](*args, *consts, **_launch_options(num_warps, cooperative))
            return
    # The first launch goes through the JIT, on the tensors' device (the compiled kernel is
    # loaded there, and the direct path above launches it on that device's stream).
    with torch.cuda.device(device):
        compiled = kernel[grid](*args, *consts, **_launch_options(num_warps, cooperative))
    if compiled is None or not hasattr(compiled, "function"):
        DIRECT_LAUNCH = False  # not the Triton we know: always go through the JIT
        return
    if len(_COMPILED) >= _MAX_COMPILED:
        _COMPILED.clear()
    _COMPILED[key] = compiled


# --------------------------------------------------------------------------- launch helpers


def _current_stream(device_index: int) -> int:
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream  # pragma: no cover


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _cdiv(a: int, b: int) -> int:
    # Plain integer arithmetic: in recent Triton, triton.cdiv is a constexpr_function whose
    # host-side call costs microseconds, which the hot path pays several times per step.
    return (a + b - 1) // b


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


# Launch configurations measured best on an H200 (50,000 rows; see the package README):
# (element size in bytes, BLOCK_H) -> (BLOCK_R, num_warps, CHUNK) for the forward, where
# CHUNK 0 reads each row once (_fwd_rows_kernel) and CHUNK > 0 reads it twice, the second
# time from L2 (_fwd_rows_reread_kernel). The re-read won where a whole tile in registers
# is 8-16 KiB per program (fourth session's H200 sweep, kernel alone): float32 x 2048
# 199.5 -> 193.9 us, x 4096 398 -> 383 us, x 8192 786 -> 766 us (mask-free), 16-bit
# x 4096 199.7 -> 194.7 us, x 8192 390.3 -> 386.5 us. 16-bit x 1024: 4 rows per program
# beat 8 in four graph-timed runs of the fifth session (bf16 53.5-53.7 against 54.1-54.5
# us; torch.compile 53.5-53.9).
_FWD_TUNED = {
    (4, 1024): (1, 4, 0), (4, 2048): (2, 16, 2048), (4, 4096): (1, 16, 2048),
    (4, 8192): (1, 16, 4096), (2, 1024): (4, 8, 0), (2, 2048): (1, 4, 0),
    (2, 4096): (1, 8, 2048), (2, 8192): (1, 16, 4096),
}
# (element size, BLOCK_H) where the re-reading forward runs without masks when the shape
# allows (CHUNK divides H, BLOCK_R the rows): float32 x 8192 780 -> 763 us, 16-bit x 8192
# 387 -> 384 us. Elsewhere it measured equal, or slower (float32 x 2048, once: 194 -> 208).
_FWD_MASK_FREE = {(4, 8192), (2, 8192)}
# -> (BLOCK_R, num_warps, programs per SM, ROW_SUM, STAGES) for the persistent backward;
# STAGES 1 prefetches one tile into registers, STAGES > 1 pipelines that many through
# shared memory. From the fourth session's H200 sweep (kernel plus the dweight sum,
# graph-timed): the pipelined loop took the 16-bit backward from 75% to 84% of copy
# bandwidth at H = 1024, 89% to 93% at 2048, 91% to 96% at 4096 and 90% to 98% at 8192;
# in float32 it gained 1% at 1024 and lost 1-3% at 4096 and 8192, where one register tile
# is already 16-32 KiB.
_BWD_TUNED = {
    (4, 1024): (4, 8, 1, False, 3), (4, 2048): (4, 8, 1, False, 1),
    (4, 4096): (2, 16, 1, False, 1), (4, 8192): (1, 8, 1, False, 1),
    (2, 1024): (2, 4, 2, True, 4), (2, 2048): (4, 4, 1, True, 3),
    (2, 4096): (2, 8, 1, False, 3), (2, 8192): (1, 16, 1, False, 3),
    (4, 16384): (1, 16, 1, False, 1), (2, 16384): (1, 16, 1, False, 1),
}


# Looped kernels (rows longer than a fused block): columns per chunk, warps, programs
# per SM.
# Measured on the H200 (4,096 rows x 65,536 and 131,072, bfloat16): one program per SM
# with 64 KiB chunks beat two per SM with 8 KiB ones (72% vs 67% of copy bandwidth at
# 65,536): 132 rows in flight (34 MB at 131,072) fit in L2, so the second read of a row
# mostly hits it. The looped backward reads x and dy twice by design (slices, then dx):
# 8,192-column slices, 8 warps, 2 programs per SM measured best (59% vs 56%).
LOOP_FWD_WARPS, LOOP_FWD_PER_SM = 16, 1
LOOP_BWD_WARPS, LOOP_BWD_PER_SM = 8, 2
LOOP_CHUNK_BWD = 8192

# Cooperative kernels for long rows (GPU only): a row is split over a group of programs,
# COOP_FWD/COOP_BWD bytes of it per program, which exchange partial sums through memory. Their
# waits need every program of the grid resident at once, so the grid is at most one
# program per SM (one block of any num_warps always fits an SM). The interpreter runs
# programs one after another, where a wait would never end: it keeps the two-pass kernels.
COOP = os.environ.get("TRITON_INTERPRET") != "1"
# element size -> (bytes of a row per program, num_warps), from the H200 sweep
# (`gpu_check.py --tune-coop`, 4,096 rows x 32,768-131,072): the forward 32 KiB with 16
# warps (85-91% of copy bandwidth for the kernel alone), the backward 16 KiB of x and of dy
# with 8 warps in 16-bit (76-79%) and 16 in float32 (89%); a 32 KiB backward spills.
COOP_FWD = {2: (32768, 16), 4: (32768, 16)}
COOP_BWD = {2: (16384, 8), 4: (16384, 16)}


@functools.lru_cache(maxsize=1024)
def fwd_config(n_cols: int, elem_size: int) -> tuple[int, int, int, int]:
    """(BLOCK_R, BLOCK_H, num_warps, CHUNK) of the fused forward for rows of ``n_cols``.

    CHUNK 0: one read of x; else x is read twice, CHUNK columns at a time (see
    ``_fwd_rows_reread_kernel``).
    """
    block_h = max(16, triton.next_power_of_2(n_cols))
    if (elem_size, block_h) in _FWD_TUNED:
        block_r, num_warps, chunk = _FWD_TUNED[(elem_size, block_h)]
        return block_r, block_h, num_warps, chunk
    # Short rows: several per program so each program moves a few KiB; long rows: one.
    block_r = max(1, min(64, 4096 // block_h))
    num_warps = max(1, min(16, block_r * block_h * elem_size // 2048))
    return block_r, block_h, num_warps, 0


@functools.lru_cache(maxsize=1024)
def bwd_config(n_cols: int, elem_size: int) -> tuple[int, int, int, int, bool, int]:
    """(BLOCK_R, BLOCK_H, num_warps, programs per SM, ROW_SUM, STAGES) of the fused backward."""
    block_h = max(16, triton.next_power_of_2(n_cols))
    if (elem_size, block_h) in _BWD_TUNED:
        block_r, num_warps, per_sm, row_sum, stages = _BWD_TUNED[(elem_size, block_h)]
        return block_r, block_h, num_warps, per_sm, row_sum, stages
    block_r = max(1, min(64, 8192 // block_h))
    num_warps = max(1, min(16, block_r * block_h // 512))
    return block_r, block_h, num_warps, 1, False, 1


# A plan's max_block when a tuning override forces the looped (0) or fused (no limit) kind.
_FORCED_MAX_BLOCK = {True: 0, False: 1 << 62}


def fwd_plan(n_cols: int, elem_size: int, looped: bool | None = None
             ) -> tuple[bool, int, int, int, int, int]:
    """(looped, BLOCK_R, BLOCK_H, num_warps, programs per SM, CHUNK).

    Looped (rows longer than a fused block): a persistent grid of ``programs per SM``, rows
    read in chunks of CHUNK. Fused: one program per BLOCK_R rows, CHUNK as in
    ``fwd_config``. ``looped`` forces one kind (tuning overrides); None picks by H.
    """
    max_block = MAX_FUSED_BLOCK_FWD if looped is None else _FORCED_MAX_BLOCK[looped]
    return _fwd_plan(n_cols, elem_size, max_block, max(1, LOOP_CHUNK * 2 // elem_size),
                     LOOP_FWD_WARPS, LOOP_FWD_PER_SM)


def clear_plan_caches() -> None:
    """Forget cached launch plans (after the tuning tables above were changed)."""
    for f in (fwd_config, bwd_config, _fwd_plan, _bwd_plan):
        f.cache_clear()


@functools.lru_cache(maxsize=1024)
def _fwd_plan(n_cols, elem_size, max_block, chunk, loop_warps, loop_per_sm):
    block_r, block_h, num_warps, reread = fwd_config(n_cols, elem_size)
    if block_h > max_block:
        return True, 1, block_h, loop_warps, loop_per_sm, min(chunk, block_h)
    return False, block_r, block_h, num_warps, 0, reread


def bwd_plan(n_cols: int, elem_size: int, looped: bool | None = None
             ) -> tuple[bool, int, int, int, int, int, bool, int]:
    """(looped, BLOCK_R, BLOCK_H, num_warps, programs per SM, CHUNK, ROW_SUM, STAGES).

    ``looped`` forces one kind (tuning overrides); None picks by H.
    """
    max_block = MAX_FUSED_BLOCK_BWD if looped is None else _FORCED_MAX_BLOCK[looped]
    return _bwd_plan(n_cols, elem_size, max_block, LOOP_CHUNK_BWD,
                     LOOP_BWD_WARPS, LOOP_BWD_PER_SM)


@functools.lru_cache(maxsize=1024)
def _bwd_plan(n_cols, elem_size, max_block, chunk, loop_warps, loop_per_sm):
    block_r, block_h, num_warps, per_sm, row_sum, stages = bwd_config(n_cols, elem_size)
    if block_h > max_block:
        return True, 1, block_h, loop_warps, loop_per_sm, min(chunk, block_h), False, 1
    return False, block_r, block_h, num_warps, per_sm, chunk, row_sum, stages


def _pow2_at_least(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (n - 1).bit_length())


def _coop_plan(x: torch.Tensor, n_rows: int, n_cols: int, config: dict | None,
               backward: bool = False) -> tuple[int, int, int, int] | None:
    """(BLOCK_H, slices per row, groups, num_warps) of a cooperative launch, or None.

    None where the two-pass looped kernels must serve: on the interpreter (unless a test
    forces ``coop`` with one slice per row), or when a row needs more slices than the
    GPU has SMs (the group could not all be resident).
    """
    coop = COOP if not config else config.get("coop", COOP)
    if not coop:
        return None
    es = x.element_size()
    block_bytes, num_warps = (COOP_BWD if backward else COOP_FWD).get(es, (16384, 8))
    block = block_bytes // es
    if config:
        block = config.get("coop_block", block)
        num_warps = config.get("coop_warps", num_warps)
    if x.get_device() < 0 and n_cols > block:
        return None  # programs that wait for each other cannot run one at a time
    layout = coop_layout(n_rows, n_cols, block, _n_programs(x, 1))
    return None if layout is None else (block, *layout, num_warps)


def coop_layout(n_rows: int, n_cols: int, block: int, max_programs: int
                ) -> tuple[int, int] | None:
    """(slices per row, groups) of a cooperative grid of at most ``max_programs``.

    A row of ``n_cols`` takes ``ceil(n_cols / block)`` slices, one program each; the grid
    holds as many whole groups as fit (never more than there are rows). None when one
    group alone would not fit: its programs could not all be resident together.
    """
    n_slices = _cdiv(n_cols, block)
    n_groups = min(n_rows, max_programs // n_slices)
    return (n_slices, n_groups) if n_groups >= 1 else None


def _n_programs(x: torch.Tensor, per_sm: int) -> int:
    """Programs in a persistent grid: ``per_sm`` per SM of x's GPU, 3 on the interpreter.

    The interpreter runs programs one by one; 3 still exercises the partial sums.
    """
    index = x.get_device()  # -1 for a CPU tensor
    return per_sm * _sm_count(index) if index >= 0 else 3


def rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, config: dict | None = None,
    need_rstd: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the forward kernel.

    Args:
        x: input (*, H) in float32/float16/bfloat16, on CUDA or (interpreter) CPU.
        weight: gain (H,).
        eps: added to the mean square.
        config: optional overrides (looped, block_r, num_warps, programs_per_sm, chunk)
            used by the benchmark's tuning sweep. For fused rows, chunk 0 reads x once
            and chunk > 0 twice (see ``fwd_config``).
        need_rstd: False when no backward will follow (inference): the fused kernels
            then skip writing rstd, and None comes back in its place.

    Returns:
        (y with x's shape and dtype, rstd of shape (rows,) in float32 or None).
    """
    if weight.device != x.device:  # the direct launch passes bare addresses
        raise ValueError(f"x is on {x.device} but weight is on {weight.device}")
    n_cols = x.shape[-1]
    x2 = _as_rows(x)
    n_rows = x2.shape[0]
    # new_empty: same dtype and device without parsing them again (host time matters here).
    y2 = x2.new_empty((n_rows, n_cols))
    if n_rows == 0:
        return (y2 if x.dim() == 2 else y2.view(x.shape)), (
            x2.new_empty((0,), dtype=torch.float32) if need_rstd else None)
    w = weight if weight.is_contiguous() else weight.contiguous()
    plan = fwd_plan(n_cols, x.element_size(), config.get("looped") if config else None)
    looped, block_r, block_h, num_warps, per_sm, chunk = plan
    if config:
        block_r = config.get("block_r", block_r)
        num_warps = config.get("num_warps", num_warps)
        per_sm = config.get("programs_per_sm", per_sm)
        chunk = config.get("chunk", chunk)
    chunk = min(chunk, block_h)
    coop = _coop_plan(x, n_rows, n_cols, config) if looped else None
    # Only the fused kernels can skip rstd (y2 then stands in for its unused pointer).
    store_rstd = need_rstd or looped
    rstd = x2.new_empty((n_rows,), dtype=torch.float32) if store_rstd else None
    args = (x2, w, y2, rstd if store_rstd else y2, n_rows, n_cols, x2.stride(0), n_cols, eps)
    if coop is not None:
        block, n_slices, n_groups, num_warps = coop
        slots = torch.zeros((n_rows, n_slices), dtype=torch.int64, device=x2.device)
        _launch(_fwd_coop_kernel, (n_groups * n_slices, 1, 1),
                (x2, w, y2, rstd, slots, n_rows, n_cols, n_slices, x2.stride(0),
                 n_cols, eps),
                (block, _pow2_at_least(n_slices)), num_warps, cooperative=True)
    elif looped:
        # One row per program at a time, read twice (sum of squares, then normalise). With
        # few programs per SM the rows in flight fit in L2, so the second read hits it.
        grid = (min(n_rows, _n_programs(x, per_sm)), 1, 1)
        _launch(_fwd_looped_kernel, grid, args, (chunk,), num_warps)
    elif chunk:
        even = (x.element_size(), block_h) in _FWD_MASK_FREE
        if config:
            even = config.get("even", even)
        even = even and n_cols % chunk == 0 and n_rows % block_r == 0
        _launch(_fwd_rows_reread_kernel, (_cdiv(n_rows, block_r), 1, 1), args,
                (block_r, chunk, even, store_rstd), num_warps)
    else:
        grid = (_cdiv(n_rows, block_r), 1, 1)
        _launch(_fwd_rows_kernel, grid, args, (block_r, block_h, store_rstd), num_warps)
    return (y2 if x.dim() == 2 else y2.view(x.shape)), (rstd if need_rstd else None)


# "torch": reduce the partial weight gradients with one ATen column sum (plus a cast);
# "triton": with _sum_partials_kernel (one launch, cast included). Same numbers either
# way up to summation order; each is bitwise reproducible on its own.
DW_REDUCE = "triton"


def _sum_partials(part: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Sum the [n_programs, H] float32 partial weight gradients over programs.

    No atomics: the order of the additions is fixed by the buffer's shape, so the result
    is bitwise reproducible.
    """
    if DW_REDUCE == "torch":
        out = part.sum(dim=0)
        return out if weight.dtype == torch.float32 else out.to(weight.dtype)
    n_part, n_cols = part.shape
    out = weight.new_empty((n_cols,))
    block_c = 64 if n_cols <= 8192 else 256
    _launch(_sum_partials_kernel, (_cdiv(n_cols, block_c), 1, 1),
            (part, out, n_part, n_cols), (16, block_c), 4)
    return out


# Sum the fused backward's partial weight gradients at the end of the backward kernel
# itself (_sum_partials_tail) instead of in a second launch, except where that measured
# slower: float32 x 4096 (16 warps at 128 registers each; 952 -> 1000 us fwd+bwd).
FOLD_DW_SUM = True
_NO_FOLD = {(4, 4096)}
# Launch shapes whose cooperative launch the driver refused (see rms_norm_bwd).
_FOLD_REFUSED: set = set()
# Nanoseconds a program waiting to sum partials sleeps between polls of the counter.
SPIN_NS = 200


def _max_summers(x: torch.Tensor) -> int:
    """How many programs may wait to sum partials: one per SM (the cooperative launch
    makes every program resident anyway, and even without it waiters could then never
    hold every SM of a whole GPU while a program they wait for is yet to start); one on
    the interpreter, which runs programs one after another."""
    index = x.get_device()
    return _sm_count(index) if index >= 0 else 1


@functools.lru_cache(maxsize=1024)  # called on every backward; next_power_of_2 costs µs
def fold_layout(n_cols: int, n_part: int, max_summers: int, max_tile: int = 4096
                ) -> tuple[int, int, int]:
    """(rows per load, columns per block, summers) for summing n_part partial rows, in
    tiles of at most ``max_tile`` elements (at least 16 x 8)."""
    summers = max(1, min(n_part, max_summers))
    block_c = min(1024, max(8, triton.next_power_of_2(_cdiv(n_cols, summers))))
    block_p = min(max(16, triton.next_power_of_2(n_part)), max(16, max_tile // block_c))
    block_c = min(block_c, max(8, max_tile // block_p))
    return block_p, block_c, min(summers, _cdiv(n_cols, block_c))


# The folded sum's counters (two int32, padded to 16 bytes; see _sum_partials_tail).
# Launches on one stream run one after another, so eager launches share one pair per
# (device, stream); launches on different streams may overlap, so they never share. A
# launch captured into a CUDA graph gets a pair of its own, taken from a pool zeroed
# before any capture (a graph may be replayed on any stream, alongside anything), or,
# when the pool is used up or was never made, a pair zeroed inside the graph.
_COUNTERS: dict = {}
_COUNTER_POOLS: dict = {}
COUNTER_POOL_SIZE = 1024


def _eager_stream(x: torch.Tensor) -> tuple[int, int] | None:
    """(device, current stream) of an eager launch on ``x``'s GPU, the key of the state
    that launches on one stream share; None on the CPU or while a CUDA graph is being
    captured, where nothing may be shared."""
    device = x.get_device()
    if device < 0 or torch.cuda.is_current_stream_capturing():
        return None
    return device, _current_stream(device)


def fold_counter(x: torch.Tensor) -> torch.Tensor:
    """Zeroed int32 counters for a folded backward launch on ``x``'s device (see above)."""
    key = _eager_stream(x)
    if key is None:
        device = x.get_device()
        if device < 0:
            return torch.zeros(4, dtype=torch.int32)
        pool = _COUNTER_POOLS.get(device)  # capturing a CUDA graph
        if pool is None or not pool:
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


# The fused backward's [programs, H] float32 partial weight gradients live only until the
# dweight sum that follows them on the same stream (in the same launch, when folded), so
# eager launches on one stream share one buffer per (device, stream), like the counters:
# an allocation costs several µs of host time, the whole cost of a small backward. The
# latest shape is kept (a few MB at most: SMs x programs per SM x H x 4 bytes). A launch
# captured into a CUDA graph gets a buffer of its own, from the graph's memory pool.
_PARTIALS: dict = {}


def partials_buffer(x: torch.Tensor, n_prog: int, n_cols: int) -> torch.Tensor:
    """An uninitialised float32 [n_prog, n_cols] buffer for the fused backward's partials."""
    key = _eager_stream(x)
    if key is None:
        return x.new_empty((n_prog, n_cols), dtype=torch.float32)
    buf = _PARTIALS.get(key)
    if buf is None or buf.shape[0] != n_prog or buf.shape[1] != n_cols:
        buf = _PARTIALS[key] = x.new_empty((n_prog, n_cols), dtype=torch.float32)
    return buf


def _launch_fused_bwd(args: tuple, consts: tuple, weight: torch.Tensor, num_warps: int,
                      fold: bool, config: dict | None) -> torch.Tensor | None:
    """Launch _bwd_rows_kernel; return dweight (None when it is not needed).

    ``args`` are the kernel's runtime arguments up to the partials buffer's strides and
    ``consts`` its constexprs up to STAGES; this adds the folded sum's (or, without
    ``fold``, sums the partials in a second kernel).
    """
    x2, dw_part, n_cols, needs_dw = args[0], args[5], args[7], consts[3]
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
    spin_ns = (config or {}).get("spin_ns", SPIN_NS) if x2.is_cuda else 0
    _launch(_bwd_rows_kernel, (dw_part.shape[0], 1, 1),
            (*args[:6], dw, counter, *args[6:], n_red),
            (*consts, fold, red_p, red_c, spin_ns), num_warps, cooperative=fold)
    if fold:
        return dw
    return _sum_partials(dw_part, weight) if needs_dw else None


def rms_norm_bwd(
    grad_output: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    *,
    needs_dx: bool = True,
    needs_dw: bool = True,
    config: dict | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Run the backward kernels; never writes into ``grad_output``.

    Args:
        grad_output: dL/dy, x's shape.
        x: the forward's input.
        weight: the forward's gain (H,).
        rstd: the forward's per-row 1/RMS, float32 (rows,).
        needs_dx: compute dL/dx (else None is returned in its place).
        needs_dw: compute dL/dweight (else None).
        config: optional overrides (block_r, num_warps, programs_per_sm, looped, chunk,
            row_sum, stages, prefetch).

    Returns:
        (dx in x's dtype and shape or None, dweight in the weight's dtype or None).
    """
    # The direct launch passes bare addresses: a tensor elsewhere must fail here.
    if grad_output.shape != x.shape or not (grad_output.device == x.device == weight.device
                                            == rstd.device):
        raise ValueError(
            f"grad_output {tuple(grad_output.shape)} on {grad_output.device} must match x "
            f"{tuple(x.shape)} on {x.device}, with weight and rstd on the same device "
            f"(weight on {weight.device}, rstd on {rstd.device})")
    n_cols = x.shape[-1]
    x2 = _as_rows(x)
    dy2 = _as_rows(grad_output)
    n_rows = x2.shape[0]
    if n_rows == 0:
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if needs_dx else None
        return dx, (torch.zeros_like(weight) if needs_dw else None)
    if not (needs_dx or needs_dw):
        return None, None
    dx2 = x2.new_empty((n_rows, n_cols)) if needs_dx else x2
    w = weight if weight.is_contiguous() else weight.contiguous()
    plan = bwd_plan(n_cols, x.element_size(), config.get("looped") if config else None)
    looped, block_r, block_h, num_warps, per_sm, chunk, row_sum, stages = plan
    if config:
        block_r = config.get("block_r", block_r)
        num_warps = config.get("num_warps", num_warps)
        per_sm = config.get("programs_per_sm", per_sm)
        chunk = min(config.get("chunk", chunk), block_h)
        row_sum = config.get("row_sum", row_sum)
        stages = config.get("stages", stages)
    coop = _coop_plan(x, n_rows, n_cols, config, backward=True) if looped else None
    if coop is not None:
        block, n_slices, n_groups, num_warps = coop
        slots = torch.zeros((n_rows, n_slices) if needs_dx else (1, 1), dtype=torch.int64,
                            device=x2.device)
        dw_part = x2.new_empty((n_groups, n_cols) if needs_dw else (1, 1), dtype=torch.float32)
        _launch(_bwd_coop_kernel, (n_groups * n_slices, 1, 1),
                (x2, w, dy2, rstd, slots, dx2, dw_part, n_rows, n_cols, n_slices,
                 x2.stride(0), dy2.stride(0), dx2.stride(0)),
                (block, _pow2_at_least(n_slices), needs_dx, needs_dw), num_warps,
                cooperative=True)
    elif looped:
        n_slices = _cdiv(n_cols, chunk)
        n_groups = min(n_rows, max(1, _n_programs(x, per_sm) // n_slices))
        dot_part = torch.empty((n_rows, n_slices), dtype=torch.float32, device=x.device)
        dw_part = torch.empty((n_groups, n_cols), dtype=torch.float32, device=x.device)
        _launch(_bwd_slices_kernel, (n_slices, n_groups, 1),
                (x2, w, dy2, rstd, dot_part, dw_part, n_rows, n_cols, x2.stride(0),
                 dy2.stride(0)),
                (chunk, needs_dx, needs_dw), num_warps)
        if needs_dx:
            _launch(_bwd_dx_looped_kernel, (n_rows, n_slices, 1),
                    (x2, w, dy2, rstd, dot_part, dx2, n_rows, n_cols, n_slices,
                     x2.stride(0), dy2.stride(0), dx2.stride(0)),
                    (chunk, _pow2_at_least(n_slices)), num_warps)
    else:
        n_prog = min(_cdiv(n_rows, block_r), _n_programs(x, per_sm))
        dw_part = partials_buffer(x2, n_prog, n_cols)
        # Prefetch into registers only where the loop is not pipelined, and where two
        # tiles fit in registers.
        prefetch = stages == 1 and block_h <= 8192
        if config:
            prefetch = config.get("prefetch", prefetch)
        fold = FOLD_DW_SUM and (x.element_size(), block_h) not in _NO_FOLD
        if config:
            fold = config.get("fold", fold)
        # The folded sum makes programs wait for others: on the GPU only in a cooperative
        # launch, where the driver guarantees that every program is resident at once.
        refusal_key = (x.get_device(), num_warps, block_r, block_h, stages, n_prog)
        fold = (fold and needs_dw and (COOPERATIVE_LAUNCH or not x.is_cuda)
                and refusal_key not in _FOLD_REFUSED)
        args = (x2, w, dy2, rstd, dx2, dw_part, n_rows, n_cols, x2.stride(0), dy2.stride(0),
                dx2.stride(0))
        consts = (block_r, block_h, needs_dx, needs_dw, prefetch, row_sum, stages)
        try:
            dw = _launch_fused_bwd(args, consts, weight, num_warps, fold, config)
        except RuntimeError as err:
            if not fold:
                raise
            # The driver refused to make the grid resident at once (a GPU shared under
            # MPS limits, say): from now on this shape sums its partials in a second kernel.
            warnings.warn(f"tritonnorm: cooperative backward launch refused ({err}); "
                          "summing dweight in a second kernel", RuntimeWarning, stacklevel=2)
            _FOLD_REFUSED.add(refusal_key)
            dw = _launch_fused_bwd(args, consts, weight, num_warps, False, config)
    if coop is not None or looped:
        dw = _sum_partials(dw_part, weight) if needs_dw else None
    if not needs_dx:
        return None, dw
    return (dx2 if x.dim() == 2 else dx2.view(x.shape)), dw
