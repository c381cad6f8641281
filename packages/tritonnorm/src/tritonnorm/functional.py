"""``rms_norm``: one entry point that picks the Triton kernels or plain PyTorch."""

from __future__ import annotations

import torch

from tritonnorm.ops.reference import RMSNormTorchFunction
from tritonnorm.ops.validation import (
    KERNEL_DTYPES,
    check_eps,
    check_rms_norm_args,
    kernel_eps,
)

try:  # Triton is optional: without it (or on a platform it lacks) CUDA tensors use PyTorch.
    from tritonnorm.ops import custom_ops as _custom_ops
    from tritonnorm.ops import kernels as _kernels
    from tritonnorm.ops.rms_norm import RMSNormFunction

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    _custom_ops = None
    _kernels = None
    RMSNormFunction = None
    HAS_TRITON = False


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x**2, -1) + eps) * weight``.

    CUDA tensors in float32/float16/bfloat16 run the Triton kernels (through the
    ``tritonnorm::`` custom ops, so ``torch.compile(fullgraph=True)`` keeps them); anything
    else runs ``RMSNormTorchFunction``. Differentiable in ``x`` and ``weight``; where no
    gradient can flow (grad mode off, or neither input requires grad) the forward kernel
    runs alone, without autograd and without writing the per-row statistic.

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
    use_kernels = (
        HAS_TRITON
        and isinstance(x, torch.Tensor)
        and isinstance(weight, torch.Tensor)
        and x.is_cuda
        and x.dtype in KERNEL_DTYPES
        and weight.dtype in KERNEL_DTYPES
    )
    if not use_kernels:
        return RMSNormTorchFunction.apply(x, weight, eps)
    # Under torch.compile the custom op keeps the kernels in the graph (fullgraph works);
    # in eager mode the autograd.Function runs the same kernels with less Python overhead
    # (and checks its arguments itself: the hot path checks them once).
    if _custom_ops.AVAILABLE and (_is_compiling() or FORCE_CUSTOM_OP):
        check_rms_norm_args(x, weight, kernel=True)
        return _custom_ops.rms_norm_triton(x, weight, check_eps(eps))
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        # Inference: nothing to record for autograd, and no rstd for a backward.
        return _kernels.rms_norm_fwd(x, weight, kernel_eps(x, weight, eps), need_rstd=False)[0]
    return RMSNormFunction.apply(x, weight, eps)


# Route eager calls through the custom op too (benchmarks and tests set this).
FORCE_CUSTOM_OP = False


def _is_compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling"):
        return compiler.is_compiling()
    return torch._dynamo.is_compiling()  # PyTorch < 2.3
