"""The ``torch.ops.tritonnorm`` operators that ``torch.compile`` traces.

On PyTorch >= 2.6 they are ``torch.library.triton_op``s whose bodies launch through
``wrap_triton``, so Inductor launches the kernels from its own code and CUDA graphs
capture them (bodies allocate everything and keep no state); on PyTorch 2.4-2.5, opaque
``custom_op``s. Arguments are checked by the entry points in ``ops``; the bodies call the host
functions of ``_host``.

No ``from __future__ import annotations``: PyTorch infers each operator's schema from the
real (not stringified) annotations; ``Optional[...]`` rather than ``| None`` for the same
reason.
"""

from typing import Optional

import torch

import tritonnorm._host as _host
from tritonnorm._launch import HAS_TRITON

HAS_TRITON_OP = hasattr(torch.library, "triton_op") and hasattr(torch.library, "wrap_triton")
HAS_LIBRARY_OPS = HAS_TRITON and (
    HAS_TRITON_OP or (hasattr(torch.library, "custom_op")
                      and hasattr(torch.library, "register_autograd")))


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] != 0 else 0


def _empty_to_none(t: torch.Tensor, wanted: bool):
    return t if wanted else None


if HAS_LIBRARY_OPS:
    _op = torch.library.triton_op if HAS_TRITON_OP else torch.library.custom_op

    @_op("tritonnorm::rms_norm_fwd", mutates_args=())
    def rms_norm_fwd_op(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float,  # noqa: UP045
                        out_dtype: Optional[torch.dtype] = None,  # noqa: UP045
                        offset: float = 0.0, llama: bool = False,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """(y, rstd)."""
        return _host.rms_norm_fwd(x, weight, eps, traceable=HAS_TRITON_OP,
                                  out_dtype=out_dtype, offset=offset, llama=llama)

    @_op("tritonnorm::rms_norm_bwd", mutates_args=())
    def rms_norm_bwd_op(grad_output: torch.Tensor, x: torch.Tensor,
                        weight: Optional[torch.Tensor],  # noqa: UP045
                        rstd: torch.Tensor, needs_dx: bool, needs_dw: bool,
                        offset: float = 0.0, llama: bool = False,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """(dx, dweight); one not asked for comes back empty (an op returns no None)."""
        dx, dw = _host.rms_norm_bwd(grad_output, x, weight, rstd, needs_dx=needs_dx,
                                    needs_dw=needs_dw, traceable=HAS_TRITON_OP,
                                    offset=offset, llama=llama)
        return (x.new_empty((0,)) if dx is None else dx,
                x.new_empty((0,)) if dw is None else dw)

    @_op("tritonnorm::fused_add_rms_norm_fwd", mutates_args=())
    def fused_add_rms_norm_fwd_op(
        x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor],  # noqa: UP045
        eps: float, out_dtype: Optional[torch.dtype] = None,  # noqa: UP045
        offset: float = 0.0, llama: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(y, x + residual, rstd)."""
        return _host.fused_add_rms_norm_fwd(x, residual, weight, eps, traceable=HAS_TRITON_OP,
                                            out_dtype=out_dtype, offset=offset, llama=llama)

    @_op("tritonnorm::fused_add_rms_norm_bwd", mutates_args=())
    def fused_add_rms_norm_bwd_op(
        grad_y: torch.Tensor, grad_sum: torch.Tensor, s: torch.Tensor,
        weight: Optional[torch.Tensor],  # noqa: UP045
        rstd: torch.Tensor, residual_dtype: torch.dtype, needs_dw: bool,
        offset: float = 0.0, llama: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dx, dresidual, dweight). Outputs may not alias each other: where the residual
        has x's dtype (one gradient serves both) dresidual comes back empty."""
        dx, dr, dw = _host.fused_add_rms_norm_bwd(grad_y, grad_sum, s, weight, rstd,
                                                  residual_dtype, needs_dw=needs_dw,
                                                  traceable=HAS_TRITON_OP, offset=offset,
                                                  llama=llama)
        return (dx, s.new_empty((0,)) if dr is dx else dr,
                s.new_empty((0,)) if dw is None else dw)

    if not HAS_TRITON_OP:  # a custom op needs its shapes spelled out for tracing

        def _dw_like(weight, needs_dw, x):
            return torch.empty_like(weight) if needs_dw else x.new_empty((0,))

        @rms_norm_fwd_op.register_fake
        def _(x, weight, eps, out_dtype=None, offset=0.0, llama=False):
            y = torch.empty_like(x, memory_format=torch.contiguous_format, dtype=out_dtype)
            return y, x.new_empty((_rows(x),), dtype=torch.float32)

        @rms_norm_bwd_op.register_fake
        def _(grad_output, x, weight, rstd, needs_dx, needs_dw, offset=0.0, llama=False):
            dx = (torch.empty_like(x, memory_format=torch.contiguous_format) if needs_dx
                  else x.new_empty((0,)))
            return dx, _dw_like(weight, needs_dw and weight is not None, x)

        @fused_add_rms_norm_fwd_op.register_fake
        def _(x, residual, weight, eps, out_dtype=None, offset=0.0, llama=False):
            y = torch.empty_like(x, memory_format=torch.contiguous_format, dtype=out_dtype)
            s = torch.empty_like(x, memory_format=torch.contiguous_format)
            return y, s, x.new_empty((_rows(x),), dtype=torch.float32)

        @fused_add_rms_norm_bwd_op.register_fake
        def _(grad_y, grad_sum, s, weight, rstd, residual_dtype, needs_dw, offset=0.0,
              llama=False):
            dx = torch.empty_like(s, memory_format=torch.contiguous_format)
            dr = (s.new_empty((0,)) if residual_dtype == s.dtype
                  else torch.empty_like(dx, dtype=residual_dtype))
            return dx, dr, _dw_like(weight, needs_dw and weight is not None, s)

    def _rms_setup(ctx, inputs, output):
        x, weight = inputs[:2]
        ctx.mode = (inputs[4], inputs[5]) if len(inputs) > 5 else (0.0, False)
        ctx.save_for_backward(x, weight, output[1])

    def _rms_backward(ctx, grad_y, _grad_rstd):
        x, weight, rstd = ctx.saved_tensors
        need_x = ctx.needs_input_grad[0]
        need_w = ctx.needs_input_grad[1] and weight is not None
        dx, dw = rms_norm_bwd_op(grad_y, x, weight, rstd, need_x, need_w, *ctx.mode)
        return _empty_to_none(dx, need_x), _empty_to_none(dw, need_w), None, None, None, None

    torch.library.register_autograd("tritonnorm::rms_norm_fwd", _rms_backward,
                                    setup_context=_rms_setup)

    def _add_setup(ctx, inputs, output):
        residual, weight = inputs[1:3]
        ctx.residual_dtype = residual.dtype
        ctx.mode = (inputs[5], inputs[6]) if len(inputs) > 6 else (0.0, False)
        ctx.save_for_backward(output[1], weight, output[2])

    def _add_backward(ctx, grad_y, grad_sum, _grad_rstd):
        s, weight, rstd = ctx.saved_tensors
        if grad_y is None:
            grad_y = torch.zeros_like(s)
        if grad_sum is None:
            grad_sum = torch.zeros_like(s)
        need_w = ctx.needs_input_grad[2] and weight is not None
        dx, dr, dw = fused_add_rms_norm_bwd_op(grad_y, grad_sum, s, weight, rstd,
                                               ctx.residual_dtype, need_w, *ctx.mode)
        dr = dx if ctx.residual_dtype == s.dtype else dr
        return dx, dr, _empty_to_none(dw, need_w), None, None, None, None

    torch.library.register_autograd("tritonnorm::fused_add_rms_norm_fwd", _add_backward,
                                    setup_context=_add_setup)
