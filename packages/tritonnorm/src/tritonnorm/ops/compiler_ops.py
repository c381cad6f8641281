"""The kernels as ``torch.ops.tritonnorm`` operators, for ``torch.compile``.

On PyTorch >= 2.6 they are ``torch.library.triton_op``s whose bodies launch through
``wrap_triton``: Inductor traces into them, sees the Triton kernels, launches them from its
generated code and captures them in CUDA graphs (``mode="reduce-overhead"``). Their bodies
allocate everything they use, never launch cooperatively and keep no state between calls,
which a graph replayed on any stream needs. On PyTorch 2.4-2.5 they are opaque
``torch.library.custom_op``s over the eager launchers (``fullgraph=True`` still works).

``register_autograd`` gives each forward its backward operator. Eager calls do not come
here: ``rms_norm`` uses the cheaper ``autograd.Function`` (see ``autograd``).

No ``from __future__ import annotations``: PyTorch infers each schema from the real (not
stringified) annotations.
"""

from typing import Optional

import torch

from tritonnorm.ops import kernels

HAS_TRITON_OP = hasattr(torch.library, "triton_op") and hasattr(torch.library, "wrap_triton")
AVAILABLE = HAS_TRITON_OP or (hasattr(torch.library, "custom_op")
                              and hasattr(torch.library, "register_autograd"))


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] != 0 else 0


def _empty_to_none(t: torch.Tensor, wanted: bool):
    return t if wanted else None


if AVAILABLE:
    _op = torch.library.triton_op if HAS_TRITON_OP else torch.library.custom_op

    @_op("tritonnorm::rms_norm_fwd", mutates_args=())
    def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float,
                     out_dtype: Optional[torch.dtype] = None,  # noqa: UP045 (schema inference)
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(y, rstd); arguments checked by the caller."""
        return kernels.rms_norm_fwd(x, weight, eps, traceable=HAS_TRITON_OP,
                                    out_dtype=out_dtype)

    @_op("tritonnorm::rms_norm_bwd", mutates_args=())
    def rms_norm_bwd(grad_output: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                     rstd: torch.Tensor, needs_dx: bool,
                     needs_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(dx, dweight); one not asked for comes back empty (an op returns no None)."""
        dx, dw = kernels.rms_norm_bwd(grad_output, x, weight, rstd, needs_dx=needs_dx,
                                      needs_dw=needs_dw, traceable=HAS_TRITON_OP)
        return (x.new_empty((0,)) if dx is None else dx,
                weight.new_empty((0,)) if dw is None else dw)

    @_op("tritonnorm::fused_add_rms_norm_fwd", mutates_args=())
    def fused_add_rms_norm_fwd(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
        out_dtype: Optional[torch.dtype] = None,  # noqa: UP045 (schema inference)
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(y, x + residual, rstd); arguments checked by the caller."""
        return kernels.fused_add_rms_norm_fwd(x, residual, weight, eps,
                                              traceable=HAS_TRITON_OP, out_dtype=out_dtype)

    @_op("tritonnorm::fused_add_rms_norm_bwd", mutates_args=())
    def fused_add_rms_norm_bwd(
        grad_y: torch.Tensor, grad_sum: torch.Tensor, s: torch.Tensor, weight: torch.Tensor,
        rstd: torch.Tensor, residual_dtype: torch.dtype, needs_dw: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dx, dresidual, dweight). An op's outputs may not alias each other, so when the
        residual has x's dtype (one gradient serves both) dresidual comes back empty."""
        dx, dr, dw = kernels.fused_add_rms_norm_bwd(grad_y, grad_sum, s, weight, rstd,
                                                    residual_dtype, needs_dw=needs_dw,
                                                    traceable=HAS_TRITON_OP)
        return (dx, s.new_empty((0,)) if dr is dx else dr,
                weight.new_empty((0,)) if dw is None else dw)

    if not HAS_TRITON_OP:  # a custom op needs its shapes spelled out for tracing

        @rms_norm_fwd.register_fake
        def _(x, weight, eps, out_dtype=None):
            y = torch.empty_like(x, memory_format=torch.contiguous_format, dtype=out_dtype)
            return y, x.new_empty((_rows(x),), dtype=torch.float32)

        @rms_norm_bwd.register_fake
        def _(grad_output, x, weight, rstd, needs_dx, needs_dw):
            dx = (torch.empty_like(x, memory_format=torch.contiguous_format) if needs_dx
                  else x.new_empty((0,)))
            return dx, torch.empty_like(weight) if needs_dw else weight.new_empty((0,))

        @fused_add_rms_norm_fwd.register_fake
        def _(x, residual, weight, eps, out_dtype=None):
            y = torch.empty_like(x, memory_format=torch.contiguous_format, dtype=out_dtype)
            s = torch.empty_like(x, memory_format=torch.contiguous_format)
            return y, s, x.new_empty((_rows(x),), dtype=torch.float32)

        @fused_add_rms_norm_bwd.register_fake
        def _(grad_y, grad_sum, s, weight, rstd, residual_dtype, needs_dw):
            dx = torch.empty_like(s, memory_format=torch.contiguous_format)
            dr = (s.new_empty((0,)) if residual_dtype == s.dtype
                  else torch.empty_like(dx, dtype=residual_dtype))
            return dx, dr, torch.empty_like(weight) if needs_dw else weight.new_empty((0,))

    def _rms_setup(ctx, inputs, output):
        x, weight = inputs[:2]
        ctx.save_for_backward(x, weight, output[1])

    def _rms_backward(ctx, grad_y, _grad_rstd):
        x, weight, rstd = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx, dw = rms_norm_bwd(grad_y, x, weight, rstd, need_x, need_w)
        return _empty_to_none(dx, need_x), _empty_to_none(dw, need_w), None, None

    torch.library.register_autograd("tritonnorm::rms_norm_fwd", _rms_backward,
                                    setup_context=_rms_setup)

    def _add_setup(ctx, inputs, output):
        residual, weight = inputs[1:3]
        ctx.residual_dtype = residual.dtype
        ctx.save_for_backward(output[1], weight, output[2])

    def _add_backward(ctx, grad_y, grad_sum, _grad_rstd):
        s, weight, rstd = ctx.saved_tensors
        if grad_y is None:
            grad_y = torch.zeros_like(s)
        if grad_sum is None:
            grad_sum = torch.zeros_like(s)
        need_w = ctx.needs_input_grad[2]
        dx, dr, dw = fused_add_rms_norm_bwd(grad_y, grad_sum, s, weight, rstd,
                                            ctx.residual_dtype, need_w)
        dr = dx if ctx.residual_dtype == s.dtype else dr
        return dx, dr, _empty_to_none(dw, need_w), None, None

    torch.library.register_autograd("tritonnorm::fused_add_rms_norm_fwd", _add_backward,
                                    setup_context=_add_setup)
