"""tritonnorm's operator, top to bottom: the entry points ``rms_norm`` and
``fused_add_rms_norm``; the dispatch rule (the Triton kernels, ``F.rms_norm`` for small
eager calls, the ``torch.ops.tritonnorm`` operators (``_library``) or Inductor's own
formula under ``torch.compile``, plain PyTorch elsewhere); the eager
``autograd.Function``s; the host functions, which pick a kernel and its configuration
(``_tuning``), allocate and launch (``_launch``). ``_machinery`` cuts an eager call's host
time (``OPTIONS.launch_machinery``).
"""

from __future__ import annotations

from typing import Optional

import torch

from tritonnorm import _launch, _library, _machinery, _tuning
from tritonnorm._launch import HAS_TRITON, n_programs, triton_unavailable_error
from tritonnorm._launch import kernels as _k
from tritonnorm._tuning import cdiv, next_pow2
from tritonnorm.options import OPTIONS
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

__all__ = ["HAS_TRITON", "OPTIONS", "FusedAddRMSNormFunction", "RMSNormFunction",
           "fused_add_rms_norm", "rms_norm"]

# ============================================================================
# The entry points
# ============================================================================


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-5, *,
             out_dtype: torch.dtype | None = None, casting_mode: str = "none",
             offset: float = 0.0) -> torch.Tensor:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x**2, -1) + eps) * (offset + weight)``.

    CUDA tensors in float32/float16/bfloat16 run the Triton kernels, or, for eager calls
    small enough to be host-bound, PyTorch's fused ``F.rms_norm`` with the same casting
    semantics (``OPTIONS``); anything else runs ``RMSNormTorchFunction``. Under
    ``torch.compile`` the kernels run as ``torch.ops.tritonnorm.rms_norm_fwd``, which
    Inductor launches itself. Where no gradient can flow the forward runs alone.

    Casting modes, with x_hat = x * rsqrt(mean(x**2) + eps) and g = offset + weight, all
    in float32: ``"none"`` (the default) and ``"gemma"`` (Hugging Face's GemmaRMSNorm with
    ``offset=1.0``) round x_hat * g once to ``out_dtype`` (default x's dtype); ``"llama"``
    (Hugging Face's LlamaRMSNorm) rounds x_hat to x's dtype first, then multiplies by g
    and rounds to ``out_dtype`` (default x's dtype promoted with the weight's). Gradients
    take a rounding as the identity; the weight's is the float32 sum of dy times what the
    weight multiplied.

    Args:
        x: input of shape (*, H); a layout whose leading dims collapse to rows without a
            copy (a contiguous per-head (batch, seq, heads, head_dim)) is not copied.
        weight: gain of shape (H,), or None (no scale); may be float32 while x is half
            precision.
        eps: added to the mean square before the square root.
        out_dtype: y's dtype. Under autocast, the autocast dtype saves the cast the next
            layer would make.
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
        return _library.rms_norm_fwd_op(x, weight, check_eps(eps), out_dtype, offset,
                                           llama)[0]
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

    The pre-norm Transformer's ``h = h + branch(...)`` then ``norm(h)``: one kernel reads
    x and residual once and writes the sum and y; one backward kernel reads the two
    incoming gradients and the sum once. New tensors are returned; the inputs are never
    modified. The sum is rounded to **x's dtype** (pass the float32 residual stream as
    ``x``), and y is computed from the rounded sum.

    Args:
        x: input of shape (*, H); the sum takes its dtype.
        residual: x's shape and device, any floating dtype the kernels take.
        weight: gain of shape (H,), or None.
        eps, out_dtype, casting_mode, offset: as ``rms_norm``.

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
        y, s, _ = _library.fused_add_rms_norm_fwd_op(x, residual, weight, check_eps(eps),
                                                     out_dtype, offset, llama)
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


# ============================================================================
# The dispatch rule
# ============================================================================


def _pick_is_compiling():
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling"):
        return compiler.is_compiling
    return torch._dynamo.is_compiling  # pragma: no cover - PyTorch < 2.3


_is_compiling = _pick_is_compiling()  # looked up once: the check runs on every call
_F_RMS_NORM = getattr(torch.nn.functional, "rms_norm", None)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


#: PyTorch >= 2.9 runs ``F.rms_norm`` on CUDA as one fused kernel each way.
HAS_FUSED_TORCH = _F_RMS_NORM is not None and _torch_version() >= (2, 9)


def _use_kernels(x, weight) -> bool:
    return (HAS_TRITON and isinstance(x, torch.Tensor)
            and (x.is_cuda or (_tuning.INTERPRET and OPTIONS.interpret_cpu))
            and x.dtype in KERNEL_DTYPES
            and (weight is None or (isinstance(weight, torch.Tensor)
                                    and weight.dtype in KERNEL_DTYPES)))


def _via_op() -> bool:
    """Under torch.compile (or when asked), go through the registered operators."""
    return _library.HAS_LIBRARY_OPS and (_is_compiling() or OPTIONS.eager_op)


def _small(x: torch.Tensor) -> bool:
    """Whether x has fewer elements than ``OPTIONS.torch_below`` names for its dtype: a
    call too small for the kernels' device-time advantage to repay their host cost."""
    below = OPTIONS.torch_below.get(str(x.dtype), 0)
    return below > 0 and x.numel() < below  # no size guard under torch.compile at 0


def _to_inductor(x: torch.Tensor, fused_add: bool) -> bool:
    """Whether a traced call takes the plain formula (``OPTIONS.compiled_dispatch``)."""
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
    """RMSNorm through PyTorch's ``F.rms_norm`` (and its backward) with tritonnorm's
    casting semantics, arguments checked."""
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
    """(llama, offset) of a public call in a mode other than the default (which the entry
    points test for inline, on the hot path), its mode and out_dtype checked."""
    if out_dtype is not None and out_dtype not in KERNEL_DTYPES:
        check_out_dtype(out_dtype)
    return check_mode(casting_mode, offset, weight)


# ============================================================================
# The eager autograd.Functions
# ============================================================================


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
    elif out_dtype not in KERNEL_DTYPES:
        check_out_dtype(out_dtype, kernel=True)  # raises, naming it
    return llama, offset, out_dtype


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm on the Triton kernels: ``apply(x, weight, eps=1e-5, out_dtype=None,
    casting_mode="none", offset=0.0)`` on CUDA tensors, or CPU ones under
    ``TRITON_INTERPRET=1``; ``weight`` may be None. It saves x, weight and a float32 rstd
    per row; the backward recomputes x_hat from them.
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
    one kernel each way: ``apply(x, residual, weight, eps=1e-5, out_dtype=None,
    casting_mode="none", offset=0.0)``. It saves s, weight and rstd; the backward writes
    one gradient shared by x and residual (and a copy in the residual's dtype if it differs).
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
# The host functions: pick a kernel and its configuration, allocate, launch
# ============================================================================

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
