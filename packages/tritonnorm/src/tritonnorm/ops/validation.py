"""Argument checks shared by every RMSNorm implementation in this package."""

from __future__ import annotations

import torch

from tritonnorm.limits import check_eps

__all__ = ["KERNEL_DTYPES", "check_eps", "check_residual", "check_rms_norm_args",
           "kernel_args_ok", "kernel_eps"]

# Dtypes the Triton kernels read and write; all of their arithmetic is float32.
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_rms_norm_args(x: torch.Tensor, weight: torch.Tensor, *, kernel: bool = False) -> None:
    """Raise a clear error when ``x`` and ``weight`` cannot be RMS-normalised together.

    Args:
        x: input of shape (*, H).
        weight: per-feature gain, expected of shape (H,).
        kernel: True when the Triton kernels will run, which take float32, float16 and
            bfloat16 only (the plain-PyTorch path also takes float64).

    Raises:
        TypeError: an argument is not a tensor, or has an integer, boolean or complex
            dtype (or float64 where the kernels run).
        ValueError: ``x`` has no dimensions or an empty last one, ``weight`` is not of
            shape (H,), or the two live on different devices.
    """
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must have a floating-point dtype, got {t.dtype}")
        if kernel and t.dtype not in KERNEL_DTYPES:
            raise TypeError(
                f"the Triton kernels take float32, float16 or bfloat16; {name} is {t.dtype} "
                "(use RMSNormTorchFunction for float64)"
            )
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the normalised one), got a scalar")
    hidden = x.shape[-1]
    if hidden == 0:
        raise ValueError(f"the normalised (last) dimension of x must be >= 1, x has shape "
                         f"{tuple(x.shape)}")
    if tuple(weight.shape) != (hidden,):
        raise ValueError(
            f"weight has shape {tuple(weight.shape)} but x of shape {tuple(x.shape)} "
            f"needs a weight of shape ({hidden},)"
        )
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but weight is on {weight.device}")


def kernel_args_ok(x, weight, eps) -> bool:
    """True when the Triton kernels can take (x, weight, eps) as they are.

    The cheap test on the hot path: a False sends the caller to ``check_rms_norm_args``
    and ``check_eps``, which either raise a clear error or accept (e.g. an int eps).
    """
    return (
        type(eps) is float
        and 0.0 <= eps < float("inf")
        and isinstance(x, torch.Tensor)
        and isinstance(weight, torch.Tensor)
        and x.dtype in KERNEL_DTYPES
        and weight.dtype in KERNEL_DTYPES
        and weight.dim() == 1
        and x.dim() > 0
        and x.shape[-1] == weight.shape[0] != 0
        and x.device == weight.device
    )


def kernel_eps(x, weight, eps) -> float:
    """Check (x, weight, eps) for the Triton kernels and return eps as a float.

    The hot path costs one ``kernel_args_ok``; only arguments it rejects go through the
    full checks, which raise a clear error or accept (an int eps, say).
    """
    if kernel_args_ok(x, weight, eps):
        return eps
    check_rms_norm_args(x, weight, kernel=True)
    return check_eps(eps)


def check_residual(x: torch.Tensor, residual: torch.Tensor, *, kernel: bool = False) -> None:
    """Raise a clear error unless ``residual`` can be added to ``x`` by fused_add_rms_norm.

    Raises:
        TypeError: residual is not a tensor, or not of a floating dtype (one the kernels
            take, where they run).
        ValueError: residual's shape or device differs from x's.
    """
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a torch.Tensor, got {type(residual).__name__}")
    if not residual.dtype.is_floating_point or (kernel and residual.dtype not in KERNEL_DTYPES):
        raise TypeError(f"residual must have a floating-point dtype the kernels take "
                        f"(float32, float16, bfloat16), got {residual.dtype}")
    if residual.shape != x.shape:
        raise ValueError(f"residual has shape {tuple(residual.shape)} but x has shape "
                         f"{tuple(x.shape)}; fused_add_rms_norm adds them elementwise")
    if residual.device != x.device:
        raise ValueError(f"x is on {x.device} but residual is on {residual.device}")
