"""The host side of the kernels: pick a kernel and its launch configuration for a shape,
allocate the outputs, launch.

Three kinds of kernel, picked by the row length H:

* fused ("rows") kernels (``rows_kernels``), for rows that fit one block of registers;
* cooperative kernels (``long_row_kernels``), for longer rows on the GPU: a row is split
  over a group of co-resident programs that exchange partial sums through memory, so x
  (and dy) are read once;
* two-pass ("looped") kernels (``long_row_kernels``), for longer rows where the
  cooperative ones cannot run (the interpreter; rows longer than the SMs can hold).

Every function takes ``traceable``: False (eager) launches through ``launcher.launch`` and
reuses per-stream workspaces; True launches through ``torch.library.wrap_triton`` with
fresh memory and no cooperative launch, as a ``torch.library.triton_op`` body must (see
``compiler_ops``).
"""

from __future__ import annotations

import warnings

import torch

from tritonnorm.ops import launch_config as lc
from tritonnorm.ops.launcher import LaunchCache, current_stream, launch_traceable, sm_count
from tritonnorm.ops.launcher import launch as _launch
from tritonnorm.ops.long_row_kernels import (
    _bwd_coop_kernel,
    _bwd_dx_looped_kernel,
    _bwd_slices_kernel,
    _fwd_coop_kernel,
    _fwd_looped_kernel,
)
from tritonnorm.ops.options import OPTIONS
from tritonnorm.ops.rows_kernels import (
    _bwd_rows_kernel,
    _fwd_rows_kernel,
    _fwd_rows_reread_kernel,
    _sum_partials_kernel,
)
from tritonnorm.ops.validation import check_residual
from tritonnorm.ops.workspaces import eager_scratch, fold_counter, partials_buffer

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
    cfg = (lc.COOP_BWD if backward else lc.COOP_FWD).get(es, lc.CoopConfig(16384, 8))
    block, num_warps = cfg.block_bytes // es, cfg.num_warps
    if config:
        block = config.get("coop_block", block)
        num_warps = config.get("coop_warps", num_warps)
    if x.get_device() < 0 and n_cols > block:
        return None  # programs that wait for each other cannot run one at a time
    layout = lc.coop_layout(n_rows, n_cols, block, _n_programs(x, 1))
    return None if layout is None else (block, *layout, num_warps)


def _sum_partials(part: torch.Tensor, weight: torch.Tensor, traceable: bool) -> torch.Tensor:
    """Sum the [n_programs, H] float32 partial weight gradients over programs, in an order
    fixed by the buffer's shape (bitwise reproducible), in the weight's dtype."""
    if OPTIONS.dw_reduce == "torch":
        out = part.sum(dim=0)
        return out if weight.dtype == torch.float32 else out.to(weight.dtype)
    n_part, n_cols = part.shape
    out = weight.new_empty((n_cols,))
    block_c = 64 if n_cols <= 8192 else 256
    _launcher(traceable)(_sum_partials_kernel, (lc.cdiv(n_cols, block_c), 1, 1),
                         (part, out, n_part, n_cols), (16, block_c), 4)
    return out


# --------------------------------------------------------------------------- forward


def rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, config: dict | None = None,
    need_rstd: bool = True, traceable: bool = False, out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the forward kernel.

    Args:
        x: input (*, H) in float32/float16/bfloat16, on CUDA or (interpreter) CPU.
        weight: gain (H,).
        eps: added to the mean square.
        config: overrides of the launch configuration (looped, block_r, num_warps,
            programs_per_sm, chunk, even, coop, coop_block, coop_warps) for tuning sweeps.
        need_rstd: False when no backward will follow (inference): the fused kernels
            then skip writing rstd, and None comes back in its place.
        traceable: launch through ``wrap_triton`` (a ``triton_op`` body).
        out_dtype: y's dtype (default x's): the cast a following autocast layer would
            make, done by the store instead of by a kernel of its own.

    Returns:
        (y with x's shape and ``out_dtype``, rstd of shape (rows,) in float32 or None).
    """
    y, _, rstd = _forward(x, None, weight, eps, config, need_rstd, traceable, out_dtype)
    return y, rstd


def fused_add_rms_norm_fwd(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
    need_rstd: bool = True, traceable: bool = False, config: dict | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """s = x + residual (in x's dtype), y = RMSNorm(s) * weight, in one pass over x and
    residual. Returns (y, s, rstd or None) of x's shape; s has x's dtype and y
    ``out_dtype`` (default x's). A residual of another shape or device is refused before
    any work (``_forward``)."""
    return _forward(x, residual, weight, eps, config, need_rstd, traceable, out_dtype)


def _all_contiguous(*tensors) -> bool:
    # A plain loop: a generator in all() costs more on this hot path.
    for t in tensors:  # noqa: SIM110
        if t is not None and not t.is_contiguous():
            return False
    return True


def _fwd_key(x, residual, weight, need_rstd, eps, out_dtype) -> tuple:
    """What fixes the grid and scalar arguments of an eager rows forward on contiguous
    tensors, whose shape gives the rows, the columns and the row stride (see LaunchCache).
    The devices are in it because the launch takes bare addresses: a plan is only ever
    recorded for a call whose tensors share a device, so a mixed call finds none."""
    r = x if residual is None else residual
    return (x.shape, r.shape, weight.shape, x.dtype, r.dtype, weight.dtype, x.get_device(),
            r.get_device(), weight.get_device(), residual is None, need_rstd, eps, out_dtype)


def _forward_fast(x, residual, weight, eps, need_rstd, out_dtype):
    """The eager rows forward of a contiguous shape launched before; None where it does
    not apply. The outputs are allocated in x's shape, so no view is made (each costs a
    dispatcher call, several µs of host time)."""
    if not _all_contiguous(x, residual, weight):
        return None
    plan = _FWD_PLANS.get(_fwd_key(x, residual, weight, need_rstd, eps, out_dtype))
    if plan is None:
        return None
    # empty_like reads shape, dtype and device from a tensor: about half the host time of
    # new_empty, which parses a shape.
    y = torch.empty_like(x, dtype=out_dtype)
    s = None if residual is None else torch.empty_like(x)
    rstd = torch.empty_like(plan[4]) if need_rstd else None
    py = y.data_ptr()
    prstd = py if rstd is None else rstd.data_ptr()  # y stands in for an unwritten rstd
    if plan[3] == 6:  # _fwd_rows_kernel
        px = x.data_ptr()
        ptrs = (px, px if residual is None else residual.data_ptr(), weight.data_ptr(), py,
                py if s is None else s.data_ptr(), prstd)
    else:  # the re-reading forward
        ptrs = (x.data_ptr(), weight.data_ptr(), py, prstd)
    if not LaunchCache.launch(plan, current_stream(x.get_device()), ptrs):
        return None
    return y, s, rstd


def _forward(x, residual, weight, eps, config, need_rstd, traceable, out_dtype=None):
    if not traceable and config is None:
        fast = _forward_fast(x, residual, weight, eps, need_rstd, out_dtype)
        if fast is not None:
            return fast
    if weight.device != x.device:  # the direct launch passes bare addresses
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
    w = weight if weight.is_contiguous() else weight.contiguous()
    looped = lc.fwd_is_looped(n_cols, config.get("looped") if config else None)
    if residual is not None and looped:
        # Rows too long for one block: the add runs apart, then the long-row forward.
        s2 = (x2.float() + _as_rows(residual).float()).to(x.dtype)
        y, _, rstd = _forward(s2, None, w, eps, config, need_rstd, traceable, out_dtype)
        return _like(y, x), _like(s2, x), rstd
    # Only the fused kernels can skip rstd (y2 then stands in for its unused pointer).
    store_rstd = need_rstd or looped
    rstd = x2.new_empty((n_rows,), dtype=torch.float32) if store_rstd else None
    launch = _launcher(traceable)
    if looped:
        _forward_long(x, x2, w, y2, rstd, n_rows, n_cols, eps, config, launch)
    else:
        block_h, cfg = lc.fwd_config(n_cols, x.element_size())
        block_r = config.get("block_r", cfg.block_r) if config else cfg.block_r
        num_warps = config.get("num_warps", cfg.num_warps) if config else cfg.num_warps
        chunk = min(config.get("chunk", cfg.chunk) if config else cfg.chunk, block_h)
        out_rstd = rstd if store_rstd else y2
        r2 = x2 if residual is None else _as_rows(residual)
        if chunk and residual is None:
            even = config.get("even", cfg.even) if config else cfg.even
            even = even and n_cols % chunk == 0 and n_rows % block_r == 0
            kernel, n_ptrs = _fwd_rows_reread_kernel, 4
            args = (x2, w, y2, out_rstd, n_rows, n_cols, x2.stride(0), n_cols, eps)
            consts = (block_r, chunk, even, store_rstd)
        else:
            kernel, n_ptrs = _fwd_rows_kernel, 6
            args = (x2, r2, w, y2, y2 if s2 is None else s2, out_rstd, n_rows, n_cols,
                    x2.stride(0), r2.stride(0), n_cols, eps)
            consts = (block_r, block_h, store_rstd, residual is not None)
        grid = (lc.cdiv(n_rows, block_r), 1, 1)
        compiled = launch(kernel, grid, args, consts, num_warps)
        if not traceable and config is None and _all_contiguous(x, residual, weight):
            key = _fwd_key(x, residual, weight, need_rstd, eps, out_dtype)
            # rstd (float32, (rows,)) as the template the fast path allocates rstd like;
            # only its shape, dtype and device are read (it keeps 4 bytes a row alive per
            # recorded shape; None when no rstd is written).
            _FWD_PLANS.record(key, compiled, grid, args, n_ptrs, consts, rstd)
    s = None if s2 is None else _like(s2, x)
    return _like(y2, x), s, (rstd if need_rstd else None)


def _forward_long(x, x2, w, y2, rstd, n_rows, n_cols, eps, config, launch):
    """Rows longer than a fused block: cooperative where it can run, else two passes."""
    coop = _coop_plan(x, n_rows, n_cols, config)
    args = (x2, w, y2, rstd, n_rows, n_cols, x2.stride(0), n_cols, eps)
    if coop is not None and launch is _launch:
        block, n_slices, n_groups, num_warps = coop
        slots = torch.zeros((n_rows, n_slices), dtype=torch.int64, device=x2.device)
        launch(_fwd_coop_kernel, (n_groups * n_slices, 1, 1),
               (x2, w, y2, rstd, slots, n_rows, n_cols, n_slices, x2.stride(0), n_cols, eps),
               (block, lc.next_pow2(n_slices, 16)), num_warps, cooperative=True)
        return
    # One row per program at a time, read twice (sum of squares, then normalise). With
    # few programs per SM the rows in flight fit in L2, so the second read hits it.
    chunk = max(1, OPTIONS.loop_chunk * 2 // x.element_size())
    num_warps, per_sm = lc.LOOP.fwd_warps, lc.LOOP.fwd_programs_per_sm
    if config:
        chunk = config.get("chunk", chunk)
        num_warps = config.get("num_warps", num_warps)
        per_sm = config.get("programs_per_sm", per_sm)
    chunk = min(chunk, lc.next_pow2(n_cols, 16))
    grid = (min(n_rows, _n_programs(x, per_sm)), 1, 1)
    launch(_fwd_looped_kernel, grid, args, (chunk,), num_warps)


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
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Run the backward kernels; never writes into ``grad_output``.

    Args:
        grad_output: dL/dy, x's shape.
        x: the forward's input.
        weight: the forward's gain (H,).
        rstd: the forward's per-row 1/RMS, float32 (rows,).
        needs_dx: compute dL/dx (else None is returned in its place).
        needs_dw: compute dL/dweight (else None).
        config: overrides of the launch configuration (block_r, num_warps,
            programs_per_sm, looped, chunk, row_sum, stages, prefetch, fold, fold_tile,
            spin_ns, coop, coop_block, coop_warps) for tuning sweeps.
        traceable: launch through ``wrap_triton`` (a ``triton_op`` body).

    Returns:
        (dx in x's dtype and shape or None, dweight in the weight's dtype or None).
    """
    dx, _, dw = _backward(grad_output, x, weight, rstd, needs_dx, needs_dw, config, None,
                          None, traceable)
    return dx, dw


def fused_add_rms_norm_bwd(
    grad_y: torch.Tensor, grad_sum: torch.Tensor | None, s: torch.Tensor, weight: torch.Tensor,
    rstd: torch.Tensor, residual_dtype: torch.dtype, *, needs_dw: bool = True,
    traceable: bool = False, config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Backward of ``fused_add_rms_norm_fwd``: x and residual get the same gradient, the
    norm's dx plus ``grad_sum`` (None when the sum was not used). Returns (dx in s's
    dtype, dresidual in ``residual_dtype`` (the same tensor when the dtypes agree), dweight
    or None)."""
    if grad_sum is not None and grad_sum.shape != s.shape:
        raise ValueError(f"grad_sum {tuple(grad_sum.shape)} must have the sum's shape "
                         f"{tuple(s.shape)}")
    return _backward(grad_y, s, weight, rstd, True, needs_dw, config, grad_sum,
                     residual_dtype, traceable)


def _bwd_key(grad_output, x, weight, rstd, ds, needs_dx, needs_dw, dr_dtype) -> tuple:
    """What fixes the grid and scalar arguments of an eager fused backward on contiguous
    tensors (see ``_fwd_key``)."""
    d = x if ds is None else ds
    return (x.shape, grad_output.shape, d.shape, weight.shape, x.dtype, grad_output.dtype,
            d.dtype, weight.dtype, dr_dtype, x.get_device(), grad_output.get_device(),
            d.get_device(), rstd.get_device(), weight.get_device(), ds is None, needs_dx,
            needs_dw, OPTIONS.fold_dw_sum)


def _backward_fast(grad_output, x, weight, rstd, needs_dx, needs_dw, ds, dr_dtype):
    """The eager, folded rows backward of a contiguous shape launched before; None where
    it does not apply. Returns (dx, dr, dweight) as ``_backward`` does, allocated in x's
    shape (no views)."""
    if not _all_contiguous(x, grad_output, ds, weight):
        return None
    plan = _BWD_PLANS.get(_bwd_key(grad_output, x, weight, rstd, ds, needs_dx, needs_dw,
                                   dr_dtype))
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
              traceable):
    if not traceable and config is None and needs_dw:
        fast = _backward_fast(grad_output, x, weight, rstd, needs_dx, needs_dw, ds, dr_dtype)
        if fast is not None:
            return fast
    # The direct launch passes bare addresses: a tensor elsewhere must fail here.
    if grad_output.shape != x.shape or not (grad_output.device == x.device == weight.device
                                            == rstd.device):
        raise ValueError(
            f"grad_output {tuple(grad_output.shape)} on {grad_output.device} must match x "
            f"{tuple(x.shape)} on {x.device}, with weight and rstd on the same device "
            f"(weight on {weight.device}, rstd on {rstd.device})")
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
    w = weight if weight.is_contiguous() else weight.contiguous()
    looped = lc.bwd_is_looped(n_cols, config.get("looped") if config else None)
    if looped:
        dw = _backward_long(x, x2, w, dy2, rstd, dx2, n_rows, n_cols, needs_dx, needs_dw,
                            config, traceable)
        dx = _like(dx2, x) if needs_dx else None
        if ds is not None:  # the fused add's gradient on long rows: added apart
            dx = dx.add_(ds)
        dr = None if dr_dtype is None else (dx.to(dr_dtype) if two_outs else dx)
        return dx, dr, dw
    ds2 = x2 if ds is None else _as_rows(ds)
    dr2 = x2.new_empty((n_rows, n_cols), dtype=dr_dtype) if two_outs else dx2
    plan_key = None
    if not traceable and config is None and _all_contiguous(x, grad_output, ds, weight):
        plan_key = _bwd_key(grad_output, x, weight, rstd, ds, needs_dx, needs_dw, dr_dtype)
    dw = _backward_rows(x, x2, w, weight, dy2, rstd, dx2, ds2, dr2, n_rows, n_cols,
                        needs_dx, needs_dw, ds is not None, two_outs, config, traceable,
                        plan_key)
    if not needs_dx:
        return None, None, dw
    dx = _like(dx2, x)
    dr = None if dr_dtype is None else (_like(dr2, x) if two_outs else dx)
    return dx, dr, dw


def _backward_rows(x, x2, w, weight, dy2, rstd, dx2, ds2, dr2, n_rows, n_cols, needs_dx,
                   needs_dw, has_ds, has_dr, config, traceable, plan_key=None):
    """The fused persistent backward; returns dweight (None when not needed). A folded
    launch is recorded under ``plan_key`` for ``_backward_fast``."""
    block_h, cfg = lc.bwd_config(n_cols, x.element_size())
    block_r, num_warps, per_sm = cfg.block_r, cfg.num_warps, cfg.programs_per_sm
    row_sum, stages = cfg.row_sum, cfg.stages
    if config:
        block_r = config.get("block_r", block_r)
        num_warps = config.get("num_warps", num_warps)
        per_sm = config.get("programs_per_sm", per_sm)
        row_sum = config.get("row_sum", row_sum)
        stages = config.get("stages", stages)
    n_prog = min(lc.cdiv(n_rows, block_r), _n_programs(x, per_sm))
    dw_part = (x2.new_empty((n_prog, n_cols), dtype=torch.float32) if traceable
               else partials_buffer(x2, n_prog, n_cols))
    # Prefetch into registers only where the loop is not pipelined and two tiles fit.
    prefetch = stages == 1 and block_h <= 8192
    fold = OPTIONS.fold_dw_sum and (x.element_size(), block_h) not in lc.NO_FOLD
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
                                 plan_key)
    except RuntimeError as err:
        if not fold:
            raise
        # The driver refused to make the grid resident at once (a GPU shared under MPS
        # limits, say): from now on this shape sums its partials in a second kernel.
        warnings.warn(f"tritonnorm: cooperative backward launch refused ({err}); "
                      "summing dweight in a second kernel", RuntimeWarning, stacklevel=3)
        _FOLD_REFUSED.add(refusal_key)
        return _launch_fused_bwd(args, consts, weight, num_warps, False, config, traceable)


def _max_summers(x: torch.Tensor) -> int:
    """How many programs may wait to sum partials: one per SM (even without a cooperative
    launch, waiters could then never hold every SM while a program they wait for is yet
    to start); one on the interpreter, which runs programs one after another."""
    index = x.get_device()
    return sm_count(index) if index >= 0 else 1


def _launch_fused_bwd(args: tuple, consts: tuple, weight: torch.Tensor, num_warps: int,
                      fold: bool, config: dict | None, traceable: bool, plan_key=None):
    """Launch _bwd_rows_kernel; return dweight (None when it is not needed).

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
        red_p, red_c, n_red = lc.fold_layout(
            n_cols, dw_part.shape[0], _max_summers(x2),
            (config or {}).get("fold_tile", min(4096, 1024 * num_warps)))
    else:  # dw_part stands in for the unused pointers
        dw, counter, (red_p, red_c, n_red) = dw_part, dw_part, (16, 16, 1)
    spin_ns = (config or {}).get("spin_ns", OPTIONS.spin_ns) if x2.is_cuda else 0
    grid = (dw_part.shape[0], 1, 1)
    full_args = (*args[:8], dw, counter, *args[8:], n_red)
    full_consts = (*consts, fold, red_p, red_c, spin_ns)
    compiled = _launcher(traceable)(_bwd_rows_kernel, grid, full_args, full_consts, num_warps,
                                    cooperative=fold)
    if fold:
        if plan_key is not None:
            _BWD_PLANS.record(plan_key, compiled, grid, full_args, 10, full_consts)
        return dw
    return _sum_partials(dw_part, weight, traceable) if needs_dw else None


def _backward_long(x, x2, w, dy2, rstd, dx2, n_rows, n_cols, needs_dx, needs_dw, config,
                   traceable):
    """Rows longer than a fused block; returns dweight (None when not needed)."""
    launch = _launcher(traceable)
    coop = None if traceable else _coop_plan(x, n_rows, n_cols, config, backward=True)
    if coop is not None:
        block, n_slices, n_groups, num_warps = coop
        slots = torch.zeros((n_rows, n_slices) if needs_dx else (1, 1), dtype=torch.int64,
                            device=x2.device)
        dw_part = x2.new_empty((n_groups, n_cols) if needs_dw else (1, 1), dtype=torch.float32)
        launch(_bwd_coop_kernel, (n_groups * n_slices, 1, 1),
               (x2, w, dy2, rstd, slots, dx2, dw_part, n_rows, n_cols, n_slices,
                x2.stride(0), dy2.stride(0), dx2.stride(0)),
               (block, lc.next_pow2(n_slices, 16), needs_dx, needs_dw), num_warps,
               cooperative=True)
    else:
        chunk, num_warps = OPTIONS.loop_chunk_bwd, lc.LOOP.bwd_warps
        per_sm = lc.LOOP.bwd_programs_per_sm
        if config:
            chunk = config.get("chunk", chunk)
            num_warps = config.get("num_warps", num_warps)
            per_sm = config.get("programs_per_sm", per_sm)
        chunk = min(chunk, lc.next_pow2(n_cols, 16))
        n_slices = lc.cdiv(n_cols, chunk)
        n_groups = min(n_rows, max(1, _n_programs(x, per_sm) // n_slices))
        dot_part = torch.empty((n_rows, n_slices), dtype=torch.float32, device=x.device)
        dw_part = torch.empty((n_groups, n_cols), dtype=torch.float32, device=x.device)
        launch(_bwd_slices_kernel, (n_slices, n_groups, 1),
               (x2, w, dy2, rstd, dot_part, dw_part, n_rows, n_cols, x2.stride(0),
                dy2.stride(0)),
               (chunk, needs_dx, needs_dw), num_warps)
        if needs_dx:
            launch(_bwd_dx_looped_kernel, (n_rows, n_slices, 1),
                   (x2, w, dy2, rstd, dot_part, dx2, n_rows, n_cols, n_slices,
                    x2.stride(0), dy2.stride(0), dx2.stride(0)),
                   (chunk, lc.next_pow2(n_slices, 16)), num_warps)
    return _sum_partials(dw_part, w, traceable) if needs_dw else None
