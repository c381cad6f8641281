"""tritonnorm's operator, top to bottom: the entry points ``rms_norm`` and
``fused_add_rms_norm``; the dispatch rule (the Triton kernels, ``F.rms_norm`` for small
eager calls, the ``torch.ops.tritonnorm`` operators (``_library``) or Inductor's own
formula under ``torch.compile``, plain PyTorch elsewhere); the eager
``autograd.Function``s. They call the host functions (``_host``), which pick a kernel and
its configuration (``_tuning``), allocate and launch (``_launch``); ``_machinery`` cuts an
eager call's host time (``OPTIONS.launch_machinery``).
"""

from __future__ import annotations

from typing import Optional

import torch

# The host functions are looked up on ``_host`` at each call, so that a test can wrap them.
import tritonnorm._host as _host
import tritonnorm._library as _library
import tritonnorm._tuning as _tuning
from tritonnorm._launch import HAS_TRITON, triton_unavailable_error
from tritonnorm._launch import kernels as _k
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
        return _host.rms_norm_fwd(x, weight, kernel_eps(x, weight, eps), need_rstd=False,
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
        y, s, _ = _host.fused_add_rms_norm_fwd(x, residual, weight,
                                               kernel_eps(x, weight, eps), need_rstd=False,
                                               out_dtype=out_dtype, offset=offset, llama=llama)
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
        y, rstd = _host.rms_norm_fwd(x, weight, eps, need_rstd=need_rstd,
                                     out_dtype=out_dtype, offset=offset, llama=llama)
        if need_rstd:
            ctx.save_for_backward(x, weight, rstd)
            ctx.mode = (offset, llama)
        return y

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        offset, llama = ctx.mode
        dx, dw = _host.rms_norm_bwd(grad_output, x, weight, rstd, needs_dx=need_x,
                                    needs_dw=need_w, offset=offset, llama=llama)
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
        y, s, rstd = _host.fused_add_rms_norm_fwd(x, residual, weight, eps,
                                                  out_dtype=out_dtype, offset=offset,
                                                  llama=llama)
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
        dx, dr, dw = _host.fused_add_rms_norm_bwd(
            grad_y, grad_sum, s, weight, rstd, ctx.residual_dtype,
            needs_dw=ctx.needs_input_grad[2], offset=offset, llama=llama)
        return dx, dr, dw, *none4
