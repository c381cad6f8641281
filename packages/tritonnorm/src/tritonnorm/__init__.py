"""tritonnorm: fused RMSNorm with Triton forward and backward kernels.

Public API:
    rms_norm(x, weight, eps=1e-5): Triton on CUDA, plain PyTorch elsewhere.
    fused_add_rms_norm(x, residual, weight, eps=1e-5) -> (y, x + residual): the residual
        add and the norm in one pass each way.
    RMSNorm, FusedAddRMSNorm: the nn.Modules.
    RMSNormFunction, FusedAddRMSNormFunction: the autograd.Functions over the kernels
        (without Triton, their ``apply`` raises an ImportError saying what to install).
    RMSNormTorchFunction: RMSNorm in plain PyTorch with a hand-derived backward.
    rms_norm_backward_x, rms_norm_backward_weight: closed-form gradients.
    OPTIONS (in tritonnorm.ops.options): the launch path's switches.
"""

from tritonnorm.functional import (
    HAS_TRITON,
    FusedAddRMSNormFunction,
    RMSNormFunction,
    fused_add_rms_norm,
    rms_norm,
)
from tritonnorm.module import FusedAddRMSNorm, RMSNorm
from tritonnorm.ops.reference import (
    RMSNormTorchFunction,
    rms_norm_backward_weight,
    rms_norm_backward_x,
    rms_norm_reference,
)
from tritonnorm.patching import replace_rms_norms

__version__ = "0.5.0"

__all__ = [
    "HAS_TRITON",
    "FusedAddRMSNorm",
    "FusedAddRMSNormFunction",
    "RMSNorm",
    "RMSNormFunction",
    "RMSNormTorchFunction",
    "fused_add_rms_norm",
    "rms_norm",
    "rms_norm_backward_weight",
    "rms_norm_backward_x",
    "rms_norm_reference",
    "replace_rms_norms",
]
