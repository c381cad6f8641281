"""RMSNorm operators: Triton kernels, a plain-PyTorch reference, closed-form gradients."""

from tritonnorm.ops.reference import (
    RMSNormTorchFunction,
    rms_norm_backward_weight,
    rms_norm_backward_x,
    rms_norm_reference,
)
from tritonnorm.ops.validation import check_rms_norm_args

__all__ = [
    "RMSNormTorchFunction",
    "check_rms_norm_args",
    "rms_norm_backward_weight",
    "rms_norm_backward_x",
    "rms_norm_reference",
]
