"""``rms_norm``: one entry point that picks the Triton kernels or plain PyTorch."""

from __future__ import annotations

import torch

from tritonnorm.ops.reference import RMSNormTorchFunction
from tritonnorm.ops.validation import KERNEL_DTYPES, check_eps, check_rms_norm_args

try:  # Triton is optional: without it (or on a platform it lacks) CUDA tensors use PyTorch.
    from tritonnorm.ops import custom_ops as _custom_ops
    from tritonnorm.ops.rms_norm import RMSNormFunction

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    _custom_ops = None
    RMSNormFunction = None
    HAS_TRITON = False


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x**2, -1) + eps) * weight``.

    CUDA tensors in float32/float16/bfloat16 run the Triton kernels (through the
    ``tritonnorm::`` custom ops, so ``torch.compile(fullgraph=True)`` keeps them); anything
    else runs ``RMSNormTorchFunction``. Differentiable in ``x`` and ``weight``.

    Args:
        x: input of shape (*, H).
        weight: gain of shape (H,); may be float32 while x is half precision.
        eps: added to the mean square before the square root.

    Returns:
        y with x's shape and dtype.

    Raises:
        ValueError: weight is not of shape (H,), or x and weight are on different devices.
        TypeError: a non-floating dtype.
    """
    check_rms_norm_args(x, weight)
    eps = check_eps(eps)
    use_kernels = (
        HAS_TRITON
        and x.is_cuda
        and x.dtype in KERNEL_DTYPES
        and weight.dtype in KERNEL_DTYPES
    )
    if not use_kernels:
        return RMSNormTorchFunction.apply(x, weight, eps)
    if _custom_ops.AVAILABLE:
        return _custom_ops.rms_norm_triton(x, weight, eps)
    return RMSNormFunction.apply(x, weight, eps)
