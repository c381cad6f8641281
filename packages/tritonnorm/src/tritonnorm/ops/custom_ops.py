"""The Triton kernels as ``torch.library`` custom ops, so torch.compile can keep them.

``torch.compile(..., fullgraph=True)`` cannot trace into a Triton launcher written in
Python, but it can treat a registered custom op as one opaque node: the fake
implementations below tell it the output shapes, and ``register_autograd`` gives it the
backward. Needs ``torch.library.custom_op`` (PyTorch 2.4+); on older PyTorch
``AVAILABLE`` is False and callers fall back to ``RMSNormFunction``.

No ``from __future__ import annotations`` here: PyTorch 2.4 infers the op schema from the
real (not stringified) annotations.
"""

import torch

from tritonnorm.ops import kernels

AVAILABLE = hasattr(torch.library, "custom_op") and hasattr(torch.library, "register_autograd")


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] != 0 else 0


if AVAILABLE:

    @torch.library.custom_op("tritonnorm::rms_norm_fwd", mutates_args=())
    def rms_norm_fwd_op(
        x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward kernel: (y, rstd). Checked by the caller."""
        return kernels.rms_norm_fwd(x, weight, eps)

    @rms_norm_fwd_op.register_fake
    def _(x, weight, eps):
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
        return y, x.new_empty((_rows(x),), dtype=torch.float32)

    @torch.library.custom_op("tritonnorm::rms_norm_bwd", mutates_args=())
    def rms_norm_bwd_op(
        grad_output: torch.Tensor,
        x: torch.Tensor,
        weight: torch.Tensor,
        rstd: torch.Tensor,
        needs_dx: bool,
        needs_dw: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Backward kernels: (dx, dweight); a gradient not asked for comes back empty (0,)."""
        dx, dw = kernels.rms_norm_bwd(
            grad_output, x, weight, rstd, needs_dx=needs_dx, needs_dw=needs_dw
        )
        # A custom op must return tensors, never None, and never its inputs' storage.
        if dx is None:
            dx = x.new_empty((0,))
        if dw is None:
            dw = weight.new_empty((0,))
        return dx, dw

    @rms_norm_bwd_op.register_fake
    def _(grad_output, x, weight, rstd, needs_dx, needs_dw):
        dx = torch.empty_like(x, memory_format=torch.contiguous_format) if needs_dx else (
            x.new_empty((0,)))
        dw = torch.empty_like(weight) if needs_dw else weight.new_empty((0,))
        return dx, dw

    def _setup_context(ctx, inputs, output):
        x, weight, _eps = inputs
        _y, rstd = output
        ctx.save_for_backward(x, weight, rstd)

    def _backward(ctx, grad_y, _grad_rstd):
        x, weight, rstd = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx, dw = rms_norm_bwd_op(grad_y, x, weight, rstd, need_x, need_w)
        return (dx if need_x else None), (dw if need_w else None), None

    torch.library.register_autograd(
        "tritonnorm::rms_norm_fwd", _backward, setup_context=_setup_context
    )


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm through the custom op (compile-friendly); arguments already checked."""
    return rms_norm_fwd_op(x, weight, eps)[0]
