"""The eager autograd.Functions over the Triton kernels: the cheapest host path.

Eager calls come here rather than through the ``torch.ops.tritonnorm`` operators: a plain
``autograd.Function`` costs a few µs per call where a registered operator with autograd
adds tens (dispatcher, schema checks, an extra autograd layer).
"""

from __future__ import annotations

import torch

from tritonnorm.ops import kernels
from tritonnorm.ops.validation import kernel_eps


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm with Triton forward and backward kernels.

    ``RMSNormFunction.apply(x, weight, eps=1e-5)`` runs on any tensor Triton takes: CUDA,
    or CPU when ``TRITON_INTERPRET=1`` was set before Triton was imported. The forward
    saves x, weight and one float32 rstd per row; the backward recomputes x_hat from them.
    y has ``out_dtype`` (default x's), dx x's dtype, dweight the weight's dtype.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        eps = kernel_eps(x, weight, eps)
        # No input needs a gradient: no backward will run, so skip rstd.
        need_rstd = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        y, rstd = kernels.rms_norm_fwd(x, weight, eps, need_rstd=need_rstd, out_dtype=out_dtype)
        if need_rstd:
            ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx, dw = kernels.rms_norm_bwd(
            grad_output, x, weight, rstd, needs_dx=need_x, needs_dw=need_w
        )
        return dx, dw, None, None


class FusedAddRMSNormFunction(torch.autograd.Function):
    """``(y, s)`` with ``s = x + residual`` (in x's dtype) and ``y = RMSNorm(s) * weight``,
    one Triton kernel each way.

    The forward reads x and residual once and writes s and y; it saves s, weight and
    rstd. The backward reads dy, ds (the gradient reaching s directly, when s was used)
    and s once, and
    writes one gradient shared by x and residual (plus a copy in the residual's dtype when
    that differs from x's) and dweight.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                eps: float = 1e-5, out_dtype: torch.dtype | None = None):
        eps = kernel_eps(x, weight, eps)
        y, s, rstd = kernels.fused_add_rms_norm_fwd(x, residual, weight, eps,
                                                    out_dtype=out_dtype)
        ctx.residual_dtype = residual.dtype
        ctx.save_for_backward(s, weight, rstd)
        # An unused output's gradient comes as None rather than a tensor of zeros made
        # for it (an allocation and a fill): the last norm of a model uses y alone.
        ctx.set_materialize_grads(False)
        return y, s

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor | None, grad_sum: torch.Tensor | None):
        if grad_y is None:  # only the sum was used: it passes its gradient on unchanged
            if grad_sum is None:
                return None, None, None, None, None
            return grad_sum, grad_sum.to(ctx.residual_dtype), None, None, None
        s, weight, rstd = ctx.saved_tensors
        dx, dr, dw = kernels.fused_add_rms_norm_bwd(
            grad_y, grad_sum, s, weight, rstd, ctx.residual_dtype,
            needs_dw=ctx.needs_input_grad[2])
        return dx, dr, dw, None, None
