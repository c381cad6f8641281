"""tritonnorm: fused RMSNorm with Triton forward and backward kernels.

Public API:
    rms_norm(x, weight, eps=1e-5): Triton on CUDA, plain PyTorch elsewhere.
    RMSNorm(hidden_size, eps=1e-5, *, device=None, dtype=None): the nn.Module.
    RMSNormFunction: autograd.Function over the Triton kernels (None without Triton).
    RMSNormTorchFunction: the same in plain PyTorch with a hand-derived backward.
    rms_norm_backward_x, rms_norm_backward_weight: closed-form gradients.
"""

from tritonnorm.functional import HAS_TRITON, RMSNormFunction, rms_norm
from tritonnorm.module import RMSNorm
from tritonnorm.ops.reference import (
    RMSNormTorchFunction,
    rms_norm_backward_weight,
    rms_norm_backward_x,
    rms_norm_reference,
)
from tritonnorm.patching import replace_rms_norms

__version__ = "0.4.1"

__all__ = [
    "HAS_TRITON",
    "RMSNorm",
    "RMSNormFunction",
    "RMSNormTorchFunction",
    "rms_norm",
    "rms_norm_backward_weight",
    "rms_norm_backward_x",
    "rms_norm_reference",
    "replace_rms_norms",
]
