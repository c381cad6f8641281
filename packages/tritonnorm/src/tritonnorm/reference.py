"""RMSNorm in plain PyTorch, and the rules every RMSNorm of this package checks its
arguments by.

The argument rules: ``check_rms_norm_args``, ``check_residual``, ``check_eps`` (from
``tritonnorm.limits``, which imports no torch) and the hot path's ``kernel_eps``.

The reference: with r = 1 / sqrt(mean(x**2) + eps) per row and x_hat = x * r, the forward
is y = x_hat * g. Differentiating (derived by hand; no autograd inside):

    dL/dg_j = sum over rows of dy_j * x_hat_j
    dL/dx_j = r * (g_j * dy_j - x_hat_j * c),   c = mean_k(g_k * dy_k * x_hat_k)

The second term is the gradient flowing through r: every x_j changes the row's RMS.
All arithmetic is float32 (float64 when an input is float64); results are cast back to
x's dtype (dx, y) and the weight's dtype (dweight).
"""

from __future__ import annotations

import torch

from tritonnorm.limits import check_eps

__all__ = ["CASTING_MODES", "KERNEL_DTYPES", "RMSNormTorchFunction", "check_eps",
           "check_mode", "check_out_dtype", "check_residual", "check_rms_norm_args",
           "default_out_dtype", "kernel_args_ok", "kernel_eps", "rms_norm_backward_weight",
           "rms_norm_backward_x", "rms_norm_reference"]

# Dtypes the Triton kernels read and write; all of their arithmetic is float32.
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


#: The casting modes: how the result is rounded on its way to y (see ``rms_norm``).
CASTING_MODES = ("none", "llama", "gemma")
#: The offsets added to the weight (in float32): 0, or 1 for Gemma's ``1 + weight``.
OFFSETS = (0.0, 1.0)


def check_mode(casting_mode: str, offset: float, weight) -> tuple[bool, float]:
    """(llama, offset as a float) for a casting mode and offset, or a clear error.

    Raises:
        ValueError: an unknown casting mode, an offset other than 0.0 or 1.0, or an
            offset without a weight.
        TypeError: casting_mode is not a str, or offset not a real number.
    """
    if not isinstance(casting_mode, str):
        raise TypeError(f"casting_mode must be a str, one of {CASTING_MODES}, got "
                        f"{type(casting_mode).__name__}")
    if casting_mode not in CASTING_MODES:
        raise ValueError(f"casting_mode must be one of {CASTING_MODES}, got {casting_mode!r}")
    if isinstance(offset, bool) or not isinstance(offset, (int, float)):
        raise TypeError(f"offset must be 0.0 or 1.0, got {type(offset).__name__}")
    if float(offset) not in OFFSETS:
        raise ValueError(f"offset must be 0.0 or 1.0 (Gemma's 1 + weight), got {offset!r}")
    if weight is None and offset != 0.0:
        raise ValueError(f"offset={offset} needs a weight to add it to; weight is None")
    return casting_mode == "llama", float(offset)


def check_out_dtype(out_dtype, *, kernel: bool = False) -> None:
    """Raise TypeError unless ``out_dtype`` is None or a floating-point torch.dtype (one the
    kernels write, where they run)."""
    if out_dtype is None:
        return
    if not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"out_dtype must be a torch.dtype or None, got "
                        f"{type(out_dtype).__name__} {out_dtype!r}")
    if not out_dtype.is_floating_point:
        raise TypeError(f"out_dtype must be a floating-point dtype, got {out_dtype}")
    if kernel and out_dtype not in KERNEL_DTYPES:
        raise TypeError(f"the Triton kernels write float32, float16 or bfloat16; out_dtype "
                        f"is {out_dtype}")


def default_out_dtype(x: torch.Tensor, weight, llama: bool) -> torch.dtype:
    """y's dtype when out_dtype is None: x's; in "llama" mode, x's promoted with the
    weight's (Hugging Face's ``weight * x_hat.to(input_dtype)``)."""
    if llama and weight is not None:
        return torch.promote_types(x.dtype, weight.dtype)
    return x.dtype


def check_rms_norm_args(x: torch.Tensor, weight, *, kernel: bool = False) -> None:
    """Raise a clear error when ``x`` and ``weight`` cannot be RMS-normalised together.

    Args:
        x: input of shape (*, H).
        weight: per-feature gain, expected of shape (H,), or None (no scale).
        kernel: True when the Triton kernels will run, which take float32, float16 and
            bfloat16 only (the plain-PyTorch path also takes float64).

    Raises:
        TypeError: an argument is not a tensor, or has an integer, boolean or complex
            dtype (or float64 where the kernels run).
        ValueError: ``x`` has no dimensions or an empty last one, ``weight`` is not of
            shape (H,), or the two live on different devices.
    """
    for name, t in (("x", x), ("weight", weight)):
        if t is None and name == "weight":
            continue
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
    if weight is None:
        return
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
    if not (type(eps) is float and 0.0 <= eps < float("inf") and isinstance(x, torch.Tensor)
            and x.dtype in KERNEL_DTYPES and x.dim() > 0 and x.shape[-1] != 0):
        return False
    if weight is None:
        return True
    return (
        isinstance(weight, torch.Tensor)
        and weight.dtype in KERNEL_DTYPES
        and weight.dim() == 1
        and x.shape[-1] == weight.shape[0]
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


def _math_dtype(*tensors) -> torch.dtype:
    # float32 arithmetic for float32/half inputs; float64 stays float64 (gradcheck needs it).
    return torch.float64 if any(t is not None and t.dtype == torch.float64
                                for t in tensors) else torch.float32


def _rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / RMS of each row of ``x`` (already in the math dtype), keeping the last dim."""
    return torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def _gain(weight, offset: float, dt: torch.dtype):
    """offset + weight in the math dtype (None without a weight)."""
    if weight is None:
        return None
    g = weight.to(dt)
    return g + offset if offset else g


def _round_like(x_hat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x_hat rounded to x's dtype, back in x_hat's, with the gradient passing straight
    through (the rounding is not differentiated, as autograd does not differentiate a
    cast): "llama" mode's ``x_hat.to(input_dtype)`` inside a higher-precision reference."""
    if x.dtype == x_hat.dtype:
        return x_hat
    return x_hat + (x_hat.to(x.dtype).to(x_hat.dtype) - x_hat).detach()


def rms_norm_reference(x: torch.Tensor, weight, eps: float = 1e-5, *,
                       casting_mode: str = "none", offset: float = 0.0,
                       out_dtype: torch.dtype | None = None,
                       compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The RMSNorm forward in plain PyTorch (differentiable by autograd).

    With r = 1 / sqrt(mean(x**2, -1) + eps), x_hat = x * r and g = offset + weight, all in
    the compute dtype:

    * ``"none"`` (the default) and ``"gemma"``: y = x_hat * g, rounded once, to out_dtype
      (default x's dtype). Hugging Face's GemmaRMSNorm (offset 1) and OLMo 2's norm;
    * ``"llama"``: y = round(x_hat to x's dtype) * g, rounded to out_dtype (default x's
      dtype promoted with the weight's). Hugging Face's LlamaRMSNorm.

    Args:
        x: input of shape (*, H), any floating dtype.
        weight: gain of shape (H,), or None (g = 1).
        eps: added to the mean square before the square root.
        casting_mode, offset, out_dtype: as ``tritonnorm.rms_norm``.
        compute_dtype: the arithmetic's dtype: float32 by default (float64 when an input
            is float64); tests pass float64 to get a float64 reference of every mode (the
            "llama" rounding still rounds to x's dtype).

    Returns:
        y of x's shape in out_dtype.
    """
    check_rms_norm_args(x, weight)
    eps = check_eps(eps)
    llama, offset = check_mode(casting_mode, offset, weight)
    check_out_dtype(out_dtype)
    dt = compute_dtype or _math_dtype(x, weight)
    xf = x.to(dt)
    x_hat = xf * _rstd(xf, eps)
    if llama:
        x_hat = _round_like(x_hat, x)
    g = _gain(weight, offset, dt)
    y = x_hat if g is None else x_hat * g
    out = out_dtype or default_out_dtype(x, weight, llama)
    # No same-dtype .to(): it returns y itself, and torch 2.11's dynamo then also returns
    # that tensor as a second output of RMSNormTorchFunction's traced forward, whose
    # gradient slot the backward ignores: x and weight got zero gradients
    # (pytorch/pytorch#180642; fixed by #180921, 2.13 is not affected).
    return y if y.dtype == out else y.to(out)


def rms_norm_backward_x(
    grad_output: torch.Tensor, x: torch.Tensor, weight, eps: float = 1e-5, *,
    offset: float = 0.0,
) -> torch.Tensor:
    """Closed-form gradient of RMSNorm with respect to ``x`` (any casting mode: the
    rounding of "llama" mode is not differentiated).

    Args:
        grad_output: dL/dy, same shape as ``x``.
        x: the forward's input, shape (*, H).
        weight: the forward's gain, shape (H,), or None.
        eps: the forward's eps.
        offset: the forward's offset.

    Returns:
        dL/dx with x's shape and dtype.
    """
    check_rms_norm_args(x, weight)
    _check_grad_shape(grad_output, x)
    _, offset = check_mode("none", offset, weight)
    dx, _ = _closed_form_grads(grad_output, x, weight, check_eps(eps), need_x=True,
                               need_w=False, offset=offset)
    return dx


def rms_norm_backward_weight(
    grad_output: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, *,
    casting_mode: str = "none",
) -> torch.Tensor:
    """Closed-form gradient of RMSNorm with respect to ``weight`` (the offset does not
    change it; in "llama" mode it sums dy times the rounded x_hat).

    Args:
        grad_output: dL/dy, same shape as ``x``.
        x: the forward's input, shape (*, H).
        weight: the forward's gain, shape (H,).
        eps: the forward's eps.
        casting_mode: the forward's.

    Returns:
        dL/dweight of shape (H,) in the weight's dtype (summed in float32 or float64).
    """
    check_rms_norm_args(x, weight)
    _check_grad_shape(grad_output, x)
    llama, _ = check_mode(casting_mode, 0.0, weight)
    _, dw = _closed_form_grads(grad_output, x, weight, check_eps(eps), need_x=False,
                               need_w=True, llama=llama)
    return dw


def _closed_form_grads(
    grad_output: torch.Tensor, x: torch.Tensor, weight, eps: float, *,
    need_x: bool, need_w: bool, offset: float = 0.0, llama: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dL/dx, dL/dweight) from one computation of rstd and x_hat; arguments checked.

    With r = 1/sqrt(mean(x**2) + eps), x_hat = x * r and g = offset + weight:
    dL/dweight = sum over rows of dy * x_hat (x_hat rounded to x's dtype in "llama" mode),
    and dL/dx = r * (g*dy - x_hat * mean(g*dy * x_hat)).
    """
    dt = _math_dtype(grad_output, x, weight)
    xf, dy = x.to(dt), grad_output.to(dt)
    r = _rstd(xf, eps)
    x_hat = xf * r
    dx = dw = None
    if need_x:
        g = _gain(weight, offset, dt)
        g_dy = dy if g is None else g * dy
        c = (g_dy * x_hat).mean(dim=-1, keepdim=True)
        dx = (r * (g_dy - x_hat * c)).to(x.dtype)
    if need_w and weight is not None:
        x_w = x_hat.to(x.dtype).to(dt) if llama else x_hat
        dw = (dy * x_w).reshape(-1, x.shape[-1]).sum(dim=0).to(weight.dtype)
    return dx, dw


def _check_grad_shape(grad_output: torch.Tensor, x: torch.Tensor) -> None:
    if tuple(grad_output.shape) != tuple(x.shape):
        raise ValueError(
            f"grad_output has shape {tuple(grad_output.shape)} but x has shape {tuple(x.shape)}"
        )


class RMSNormTorchFunction(torch.autograd.Function):
    """RMSNorm in plain PyTorch with the hand-derived backward above.

    ``RMSNormTorchFunction.apply(x, weight, eps=1e-5, out_dtype=None, casting_mode="none",
    offset=0.0)``; runs on any device and dtype (float64 included, so
    ``torch.autograd.gradcheck`` can check the derivation); ``weight`` may be None.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight, eps: float = 1e-5,
                out_dtype: torch.dtype | None = None, casting_mode: str = "none",
                offset: float = 0.0) -> torch.Tensor:
        y = rms_norm_reference(x, weight, eps, casting_mode=casting_mode, offset=offset,
                               out_dtype=out_dtype)
        ctx.save_for_backward(x, weight)
        ctx.eps = float(eps)
        ctx.offset = float(offset)
        ctx.llama = casting_mode == "llama"
        return y

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_x or need_w):
            return None, None, None, None, None, None
        # Both closed forms share rstd and x_hat: compute them once (forward checked the args).
        dx, dw = _closed_form_grads(grad_output, x, weight, ctx.eps, need_x=need_x,
                                    need_w=need_w, offset=ctx.offset, llama=ctx.llama)
        return dx, dw, None, None, None, None
