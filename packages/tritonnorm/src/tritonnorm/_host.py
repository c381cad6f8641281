"""tritonnorm's host functions: for one call, pick a kernel and its launch configuration
(``_tuning``), allocate the outputs and scratch, and launch (``_launch``, or ``_machinery``'s
direct launcher when ``OPTIONS.launch_machinery`` is on).

``ops``' eager ``autograd.Function``s and ``_library``'s ``torch.ops.tritonnorm`` operators
both call them; their arguments are checked by ``ops``' entry points before they get here.
"""

from __future__ import annotations

import torch

import tritonnorm._launch as _launch
import tritonnorm._machinery as _machinery
import tritonnorm._tuning as _tuning
from tritonnorm._launch import kernels as _k
from tritonnorm._launch import n_programs
from tritonnorm._tuning import cdiv, next_pow2
from tritonnorm.options import OPTIONS
from tritonnorm.reference import check_residual

__all__ = ["fused_add_rms_norm_bwd", "fused_add_rms_norm_fwd", "rms_norm_bwd", "rms_norm_fwd"]

#: The kernels' mode constexprs (``Mode``'s fields, a plain tuple on the hot path) of a
#: plain RMSNorm with a weight.
_PLAIN = (True, 0.0, False)


def _mode(weight, offset: float, llama: bool) -> tuple[bool, float, bool]:
    return weight is not None, float(offset), bool(llama)


def _launcher(traceable: bool):
    if traceable:
        return _launch.traceable
    return _machinery.launch if OPTIONS.launch_machinery else _launch.jit


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D (rows, H) view of ``t`` with unit column stride (copies only when it must)."""
    if t.dim() == 2 and t.stride(1) == 1:
        return t
    if t.dim() == 0 or t.stride(-1) != 1:
        t = t.contiguous()
    t2 = t.reshape(-1, t.shape[-1])
    if t2.shape[0] > 1 and t2.stride(1) != 1:
        t2 = t2.contiguous()
    return t2


def _like(t2: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The (rows, H) result ``t2`` in x's shape (a view)."""
    return t2 if x.dim() == 2 else t2.view(x.shape)


# --------------------------------------------------------------------------- forward


def rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, need_rstd: bool = True,
    traceable: bool = False, out_dtype: torch.dtype | None = None, offset: float = 0.0,
    llama: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the forward kernel on x (*, H) and weight (H,) or None; return (y with x's
    shape and ``out_dtype`` (default x's), float32 rstd (rows,) or None).

    ``need_rstd=False`` (no backward to follow) lets the fused kernels skip rstd;
    ``traceable`` launches through ``wrap_triton`` (a ``triton_op`` body); ``offset`` is
    added to the weight in float32; ``llama`` rounds x_hat to x's dtype before the weight
    multiplies it.
    """
    y, _, rstd = _forward(x, None, weight, eps, need_rstd, traceable, out_dtype,
                          _mode(weight, offset, llama))
    return y, rstd


def fused_add_rms_norm_fwd(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
    need_rstd: bool = True, traceable: bool = False, out_dtype: torch.dtype | None = None,
    offset: float = 0.0, llama: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """s = x + residual (in x's dtype), y = RMSNorm(s) * weight, in one pass over x and
    residual. Returns (y, s, rstd or None) of x's shape; s has x's dtype and y
    ``out_dtype`` (default x's). A residual of another shape or device is refused before
    any work."""
    return _forward(x, residual, weight, eps, need_rstd, traceable, out_dtype,
                    _mode(weight, offset, llama))


def _forward(x, residual, weight, eps, need_rstd, traceable, out_dtype=None, mode=_PLAIN):
    # The launch machinery, unless switched off or traced (Inductor makes those launches).
    m = None if traceable or not OPTIONS.launch_machinery else _machinery
    if m is not None:
        fast = m.replay_forward(x, residual, weight, eps, need_rstd, out_dtype, mode)
        if fast is not None:
            return fast
    if weight is not None and weight.device != x.device:  # launches take bare addresses
        raise ValueError(f"x is on {x.device} but weight is on {weight.device}")
    if residual is not None and (residual.shape != x.shape or residual.device != x.device):
        check_residual(x, residual, kernel=True)  # raises, naming what differs
    # The row length picks the kernel: under torch.compile with dynamic shapes it is
    # specialised (int()), as Inductor would have to anyway.
    n_cols = int(x.shape[-1])
    x2 = _as_rows(x)
    n_rows = x2.shape[0]
    # new_empty: x's dtype and device without parsing them again.
    y2 = x2.new_empty((n_rows, n_cols), dtype=out_dtype)
    s2 = None if residual is None else x2.new_empty((n_rows, n_cols))
    if n_rows == 0:
        rstd = x2.new_empty((0,), dtype=torch.float32) if need_rstd else None
        s = None if s2 is None else _like(s2, x)
        return _like(y2, x), s, rstd
    # x stands in for an absent weight (HAS_W is False: nothing reads it).
    w = x2 if weight is None else weight if weight.is_contiguous() else weight.contiguous()
    paths = _tuning.paths()
    looped = _tuning.fwd_is_looped(n_cols, paths)
    if residual is not None and looped:
        # Rows too long for one block: the add runs apart, then the long-row forward.
        s2 = (x2.float() + _as_rows(residual).float()).to(x.dtype)
        y, _, rstd = _forward(s2, None, weight, eps, need_rstd, traceable, out_dtype, mode)
        return _like(y, x), _like(s2, x), rstd
    # Only the fused kernels can skip rstd (y2 then stands in for its pointer).
    store_rstd = need_rstd or looped
    rstd = x2.new_empty((n_rows,), dtype=torch.float32) if store_rstd else None
    launch = _launcher(traceable)
    if looped:
        _forward_long(x, x2, w, y2, rstd, n_rows, n_cols, eps, paths, launch, mode)
    else:
        block_h, cfg = _tuning.fwd_config(n_cols, x.element_size())
        out_rstd = rstd if store_rstd else y2
        if cfg.chunk and residual is None:
            even = cfg.even and n_cols % cfg.chunk == 0 and n_rows % cfg.block_r == 0
            kernel = _k.fwd_rows_reread_kernel
            args = _launch.FwdRereadArgs(
                X=x2, W=w, Y=y2, RSTD=out_rstd, n_rows=n_rows, n_cols=n_cols,
                stride_x=x2.stride(0), stride_y=n_cols, eps=eps)
            consts = _launch.FwdRereadConsts(cfg.block_r, cfg.chunk, even, store_rstd, *mode)
        else:
            r2 = x2 if residual is None else _as_rows(residual)
            kernel = _k.fwd_rows_kernel
            args = _launch.FwdRowsArgs(
                X=x2, R=r2, W=w, Y=y2, S=y2 if s2 is None else s2, RSTD=out_rstd,
                n_rows=n_rows, n_cols=n_cols, stride_x=x2.stride(0), stride_r=r2.stride(0),
                stride_y=n_cols, eps=eps)
            consts = _launch.FwdRowsConsts(cfg.block_r, block_h, store_rstd,
                                           residual is not None, *mode)
        grid = (cdiv(n_rows, cfg.block_r), 1, 1)
        compiled = launch(kernel, grid, args, consts, cfg.num_warps)
        if m is not None:
            m.record_forward(x, residual, weight, need_rstd, eps, out_dtype, mode, compiled,
                             kernel, grid, args, consts, rstd)
    s = None if s2 is None else _like(s2, x)
    return _like(y2, x), s, (rstd if need_rstd else None)


def _forward_long(x, x2, w, y2, rstd, n_rows, n_cols, eps, paths, launch, mode):
    """Rows longer than a fused block: cooperative where it can run, else two passes."""
    coop = _tuning.coop_plan(n_rows, n_cols, x.element_size(), x.get_device() >= 0,
                             n_programs(x, 1), paths.coop, backward=False)
    if coop is not None and launch is not _launch.traceable:
        block, n_slices, n_groups, num_warps = coop
        slots = torch.zeros((n_rows, n_slices), dtype=torch.int64, device=x2.device)
        launch(_k.fwd_coop_kernel, (n_groups * n_slices, 1, 1),
               _launch.FwdCoopArgs(X=x2, W=w, Y=y2, RSTD=rstd, SLOTS=slots, n_rows=n_rows,
                                   n_cols=n_cols, n_slices=n_slices, stride_x=x2.stride(0),
                                   stride_y=n_cols, eps=eps),
               _launch.FwdCoopConsts(block, next_pow2(n_slices, 16), *mode), num_warps,
               cooperative=True)
        return
    # One row per program at a time, read twice; with few programs per SM the rows in
    # flight fit in L2, where the second read finds them.
    cfg = _tuning.long_config(n_cols, x.element_size(), False, paths)
    grid = (min(n_rows, n_programs(x, cfg.programs_per_sm)), 1, 1)
    launch(_k.fwd_looped_kernel, grid,
           _launch.FwdLoopedArgs(X=x2, W=w, Y=y2, RSTD=rstd, n_rows=n_rows, n_cols=n_cols,
                                 stride_x=x2.stride(0), stride_y=n_cols, eps=eps),
           _launch.FwdLoopedConsts(cfg.chunk, *mode), cfg.num_warps)


# --------------------------------------------------------------------------- backward


def rms_norm_bwd(
    grad_output: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, *,
    needs_dx: bool = True, needs_dw: bool = True, traceable: bool = False,
    offset: float = 0.0, llama: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Run the backward kernels (never writing into ``grad_output``) from the forward's
    x, weight and rstd; return (dx in x's dtype or None, dweight in the weight's dtype or
    None), each None where ``needs_dx`` or ``needs_dw`` says it is not wanted. ``offset``
    and ``llama`` are the forward's.
    """
    dx, _, dw = _backward(grad_output, x, weight, rstd, needs_dx, needs_dw, None, None,
                          traceable, _mode(weight, offset, llama))
    return dx, dw


def fused_add_rms_norm_bwd(
    grad_y: torch.Tensor, grad_sum: torch.Tensor | None, s: torch.Tensor, weight: torch.Tensor,
    rstd: torch.Tensor, residual_dtype: torch.dtype, *, needs_dw: bool = True,
    traceable: bool = False, offset: float = 0.0, llama: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Backward of ``fused_add_rms_norm_fwd``: x and residual get the same gradient, the
    norm's dx plus ``grad_sum`` (None when the sum was not used). Returns (dx in s's
    dtype, dresidual in ``residual_dtype`` (the same tensor when the dtypes agree), dweight
    or None)."""
    if grad_sum is not None and grad_sum.shape != s.shape:
        raise ValueError(f"grad_sum {tuple(grad_sum.shape)} must have the sum's shape "
                         f"{tuple(s.shape)}")
    return _backward(grad_y, s, weight, rstd, True, needs_dw, grad_sum, residual_dtype,
                     traceable, _mode(weight, offset, llama))


def _backward(grad_output, x, weight, rstd, needs_dx, needs_dw, ds, dr_dtype, traceable,
              mode=_PLAIN):
    needs_dw = needs_dw and weight is not None
    m = None if traceable or not OPTIONS.launch_machinery else _machinery
    if m is not None and needs_dw:
        fast = m.replay_backward(grad_output, x, weight, rstd, needs_dx, ds, dr_dtype, mode)
        if fast is not None:
            return fast
    w_device = x.device if weight is None else weight.device
    # Launches take bare addresses: a tensor elsewhere must fail here.
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
    paths = _tuning.paths()
    if _tuning.bwd_is_looped(n_cols, paths):
        dw = _backward_long(x, x2, w, dy2, rstd, dx2, n_rows, n_cols, needs_dx, needs_dw,
                            traceable, paths, mode)
        dx = _like(dx2, x) if needs_dx else None
        if ds is not None:  # the fused add's gradient on long rows: added apart
            dx = dx.add_(ds)
        dr = None if dr_dtype is None else (dx.to(dr_dtype) if two_outs else dx)
        return dx, dr, dw
    ds2 = x2 if ds is None else _as_rows(ds)
    dr2 = x2.new_empty((n_rows, n_cols), dtype=dr_dtype) if two_outs else dx2
    plan_key = (m.backward_key(grad_output, x, weight, rstd, ds, needs_dx, dr_dtype, mode)
                if m is not None and needs_dw else None)
    dw = _backward_rows(x, x2, w, weight, dy2, rstd, dx2, ds2, dr2, n_rows, n_cols,
                        needs_dx, needs_dw, ds is not None, two_outs, traceable, plan_key,
                        paths, mode)
    if not needs_dx:
        return None, None, dw
    dx = _like(dx2, x)
    dr = None if dr_dtype is None else (_like(dr2, x) if two_outs else dx)
    return dx, dr, dw


def _backward_rows(x, x2, w, weight, dy2, rstd, dx2, ds2, dr2, n_rows, n_cols, needs_dx,
                   needs_dw, has_ds, has_dr, traceable, plan_key, paths, mode):
    """The fused persistent backward; returns dweight (or None)."""
    block_h, cfg = _tuning.bwd_config(n_cols, x.element_size())
    n_prog = min(cdiv(n_rows, cfg.block_r), n_programs(x, cfg.programs_per_sm))
    m = None if traceable or not OPTIONS.launch_machinery else _machinery
    dw_part = (x2.new_empty((n_prog, n_cols), dtype=torch.float32) if m is None
               else m.partials_buffer(x2, n_prog, n_cols))
    grid = (n_prog, 1, 1)
    # Unfolded, dw_part stands in for the pointers only the folded sum uses.
    args = _launch.BwdRowsArgs(
        X=x2, W=w, DY=dy2, RSTD=rstd, DX=dx2, DW_PART=dw_part, DS=ds2, DR=dr2, DW=dw_part,
        COUNTER=dw_part, n_rows=n_rows, n_cols=n_cols, stride_x=x2.stride(0),
        stride_dy=dy2.stride(0), stride_dx=dx2.stride(0), stride_ds=ds2.stride(0), n_red=1)
    consts = _launch.BwdRowsConsts(
        cfg.block_r, block_h, needs_dx, needs_dw, cfg.prefetch, cfg.row_sum, cfg.stages,
        has_ds, has_dr, False, 16, 16, cfg.spin_ns if x2.is_cuda else 0, *mode)
    if m is not None and needs_dw and cfg.fold:
        dw = m.folded_backward(weight, grid, args, consts, cfg.num_warps, cfg.fold_tile,
                               plan_key)
        if dw is not None:
            return dw
    _launcher(traceable)(_k.bwd_rows_kernel, grid, args, consts, cfg.num_warps)
    return _sum_partials(dw_part, weight, traceable, paths) if needs_dw else None


def _backward_long(x, x2, w, dy2, rstd, dx2, n_rows, n_cols, needs_dx, needs_dw, traceable,
                   paths, mode):
    """Rows longer than a fused block; returns dweight (None when not needed)."""
    launch = _launcher(traceable)
    coop = None if traceable else _tuning.coop_plan(
        n_rows, n_cols, x.element_size(), x.get_device() >= 0, n_programs(x, 1), paths.coop,
        backward=True)
    if coop is not None:
        block, n_slices, n_groups, num_warps = coop
        slots = torch.zeros((n_rows, n_slices) if needs_dx else (1, 1), dtype=torch.int64,
                            device=x2.device)
        # The partials are accumulated even where nobody wants them (no weight, or a
        # frozen one): the kernel runs faster so (docs/benchmarks/README.md, "long rows").
        dw_part = x2.new_empty((n_groups, n_cols), dtype=torch.float32)
        launch(_k.bwd_coop_kernel, (n_groups * n_slices, 1, 1),
               _launch.BwdCoopArgs(X=x2, W=w, DY=dy2, RSTD=rstd, SLOTS=slots, DX=dx2,
                                   DW_PART=dw_part, n_rows=n_rows, n_cols=n_cols,
                                   n_slices=n_slices, stride_x=x2.stride(0),
                                   stride_dy=dy2.stride(0), stride_dx=dx2.stride(0)),
               _launch.BwdCoopConsts(block, next_pow2(n_slices, 16), needs_dx, True, *mode),
               num_warps, cooperative=True)
    else:
        cfg = _tuning.long_config(n_cols, x.element_size(), True, paths)
        n_slices = cdiv(n_cols, cfg.chunk)
        n_groups = min(n_rows, max(1, n_programs(x, cfg.programs_per_sm) // n_slices))
        dot_part = torch.empty((n_rows, n_slices), dtype=torch.float32, device=x.device)
        dw_part = torch.empty((n_groups, n_cols), dtype=torch.float32, device=x.device)
        launch(_k.bwd_slices_kernel, (n_slices, n_groups, 1),
               _launch.BwdSlicesArgs(X=x2, W=w, DY=dy2, RSTD=rstd, DOT_PART=dot_part,
                                     DW_PART=dw_part, n_rows=n_rows, n_cols=n_cols,
                                     stride_x=x2.stride(0), stride_dy=dy2.stride(0)),
               _launch.BwdSlicesConsts(cfg.chunk, needs_dx, needs_dw, *mode), cfg.num_warps)
        if needs_dx:
            launch(_k.bwd_dx_looped_kernel, (n_rows, n_slices, 1),
                   _launch.BwdDxLoopedArgs(X=x2, W=w, DY=dy2, RSTD=rstd, DOT_PART=dot_part,
                                           DX=dx2, n_rows=n_rows, n_cols=n_cols,
                                           n_slices=n_slices, stride_x=x2.stride(0),
                                           stride_dy=dy2.stride(0), stride_dx=dx2.stride(0)),
                   _launch.BwdDxLoopedConsts(cfg.chunk, next_pow2(n_slices, 16), *mode),
                   cfg.num_warps)
    return _sum_partials(dw_part, w, traceable, paths) if needs_dw else None


def _sum_partials(part: torch.Tensor, weight: torch.Tensor, traceable: bool, paths
                  ) -> torch.Tensor:
    """The [n_programs, H] float32 partial weight gradients summed over programs, in an
    order fixed by the buffer's shape (bitwise reproducible), in the weight's dtype."""
    if paths.dw_reduce == "torch":
        out = part.sum(dim=0)
        return out if weight.dtype == torch.float32 else out.to(weight.dtype)
    n_part, n_cols = part.shape
    out = weight.new_empty((n_cols,))
    block_c = 64 if n_cols <= 8192 else 256
    _launcher(traceable)(_k.sum_partials_kernel, (cdiv(n_cols, block_c), 1, 1),
                         _launch.SumPartialsArgs(PART=part, OUT=out, n_part=n_part,
                                                 n_cols=n_cols),
                         _launch.SumPartialsConsts(16, block_c), 4)
    return out
