"""``RMSNorm``: a thin nn.Module over ``rms_norm``."""

from __future__ import annotations

import torch
from torch import nn

from tritonnorm.functional import fused_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """Root-mean-square normalisation over the last dimension with a learned gain.

    Its only parameter is ``weight`` (shape (hidden_size,), initialised to ones), so its
    state dict loads into ``torch.nn.RMSNorm(hidden_size)`` and back. On CUDA it runs the
    Triton kernels (under ``torch.compile`` as Triton operators Inductor launches itself).

    Args:
        hidden_size: H, the size of the normalised last dimension.
        eps: added to the mean square before the square root.
        device: where to create ``weight``.
        dtype: dtype of ``weight``.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
        if dtype is not None and not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point dtype, got {dtype}")
        self.hidden_size = hidden_size
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class FusedAddRMSNorm(RMSNorm):
    """``forward(x, residual) -> (norm(x + residual), x + residual)``, fused.

    The module form of ``fused_add_rms_norm``: same parameter (and state dict) as
    ``RMSNorm``. The sum takes x's dtype; pass the residual stream as ``x``.
    """

    def forward(self, x: torch.Tensor, residual: torch.Tensor):  # type: ignore[override]
        return fused_add_rms_norm(x, residual, self.weight, self.eps)
