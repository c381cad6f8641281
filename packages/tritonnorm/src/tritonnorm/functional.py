"""``rms_norm`` and ``fused_add_rms_norm``: entry points that pick the Triton kernels or
plain PyTorch."""

from __future__ import annotations

import torch

from tritonnorm.ops.reference import RMSNormTorchFunction
from tritonnorm.ops.validation import (
    KERNEL_DTYPES,
    check_eps,
    check_residual,
    check_rms_norm_args,
    kernel_eps,
)

try:  # Triton is optional: without it (or on a platform it lacks) CUDA tensors use PyTorch.
    from tritonnorm.ops import compiler_ops as _compiler_ops
    from tritonnorm.ops import kernels as _kernels
    from tritonnorm.ops.autograd import FusedAddRMSNormFunction, RMSNormFunction
    from tritonnorm.ops.options import OPTIONS

    HAS_TRITON = True
    TRITON_IMPORT_ERROR: ImportError | None = None
except ImportError as _err:  # pragma: no cover - depends on the environment
    _compiler_ops = _kernels = OPTIONS = None
    HAS_TRITON = False
    TRITON_IMPORT_ERROR = _err

    class _KernelsUnavailable:
        """Stands in for the kernels' autograd.Functions: ``apply`` says what is missing."""

        @staticmethod
        def apply(*args, **kwargs):
            raise triton_unavailable_error()

    FusedAddRMSNormFunction = RMSNormFunction = _KernelsUnavailable


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


def _use_kernels(x, weight) -> bool:
    return (HAS_TRITON and isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)
            and x.is_cuda and x.dtype in KERNEL_DTYPES and weight.dtype in KERNEL_DTYPES)


def _kernel_out(out_dtype) -> bool:
    return out_dtype is None or out_dtype in KERNEL_DTYPES


def _via_op() -> bool:
    """Under torch.compile (or when asked), go through the registered operators."""
    return _compiler_ops.AVAILABLE and (_is_compiling() or OPTIONS.eager_op)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, *,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x**2, -1) + eps) * weight``.

    CUDA tensors in float32/float16/bfloat16 run the Triton kernels; anything else runs
    ``RMSNormTorchFunction``. Eager calls go through ``RMSNormFunction``; under
    ``torch.compile`` through ``torch.ops.tritonnorm.rms_norm_fwd``, which Inductor
    launches itself (``fullgraph=True`` and ``mode="reduce-overhead"`` work). Where no
    gradient can flow the forward kernel runs alone, without writing the per-row statistic.

    Args:
        x: input of shape (*, H).
        weight: gain of shape (H,); may be float32 while x is half precision.
        eps: added to the mean square before the square root.
        out_dtype: y's dtype, x's by default. Under autocast, the autocast dtype saves the
            cast the next layer would make (one kernel and a pass over y each way).

    Returns:
        y with x's shape and ``out_dtype``.

    Raises:
        ValueError: weight is not of shape (H,), or x and weight are on different devices.
        TypeError: a non-floating dtype.
    """
    if not _use_kernels(x, weight) or not _kernel_out(out_dtype):
        y = RMSNormTorchFunction.apply(x, weight, eps)
        return y if out_dtype is None else y.to(out_dtype)
    if _via_op():
        check_rms_norm_args(x, weight, kernel=True)
        return _compiler_ops.rms_norm_fwd(x, weight, check_eps(eps), out_dtype)[0]
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        # Inference: nothing to record for autograd, and no rstd for a backward.
        return _kernels.rms_norm_fwd(x, weight, kernel_eps(x, weight, eps), need_rstd=False,
                                     out_dtype=out_dtype)[0]
    return RMSNormFunction.apply(x, weight, eps, out_dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, *,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual, weight, eps), x + residual)`` in one pass each way.

    The pre-norm Transformer's ``h = h + branch(...)`` then ``norm(h)``: on CUDA one
    Triton kernel reads x and residual once and writes the sum and the normalised sum,
    and one backward kernel reads the two incoming gradients and the sum once. This
    saves a full read and write of the residual stream at every norm. New tensors are
    returned; the inputs are never modified (which torch.compile and CUDA graphs need).

    The sum is rounded to **x's dtype** (pass the residual stream as ``x`` when it is
    float32 and the branch output half precision), and y is computed from the rounded
    sum, exactly as ``rms_norm((x + residual).to(x.dtype), weight)`` would.

    Args:
        x: input of shape (*, H); the sum takes its dtype.
        residual: what to add to x: x's shape and device, any floating dtype the kernels
            take.
        weight: gain of shape (H,).
        eps: added to the mean square before the square root.
        out_dtype: y's dtype, x's by default (see ``rms_norm``).

    Returns:
        (y, x + residual) with x's shape; the sum in x's dtype, y in ``out_dtype``.

    Raises:
        ValueError: residual's shape or device differs from x's, or weight is not (H,).
        TypeError: a non-floating dtype.
    """
    if not (_use_kernels(x, weight) and isinstance(residual, torch.Tensor)
            and residual.dtype in KERNEL_DTYPES and _kernel_out(out_dtype)):
        check_rms_norm_args(x, weight)
        check_residual(x, residual)
        s = (x + residual).to(x.dtype)
        y = RMSNormTorchFunction.apply(s, weight, eps)
        return (y if out_dtype is None else y.to(out_dtype)), s
    # A residual of another shape or device is refused by the launcher, before any work.
    if _via_op():
        check_rms_norm_args(x, weight, kernel=True)
        y, s, _ = _compiler_ops.fused_add_rms_norm_fwd(x, residual, weight, check_eps(eps),
                                                       out_dtype)
        return y, s
    if not (torch.is_grad_enabled()
            and (x.requires_grad or residual.requires_grad or weight.requires_grad)):
        y, s, _ = _kernels.fused_add_rms_norm_fwd(x, residual, weight,
                                                  kernel_eps(x, weight, eps), need_rstd=False,
                                                  out_dtype=out_dtype)
        return y, s
    return FusedAddRMSNormFunction.apply(x, residual, weight, eps, out_dtype)
