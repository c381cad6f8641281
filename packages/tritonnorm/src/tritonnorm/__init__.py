"""tritonnorm: fused RMSNorm with Triton forward and backward kernels.

Public API:
    rms_norm(x, weight, eps=1e-5, *, out_dtype, casting_mode, offset): Triton on CUDA
        (PyTorch's F.rms_norm for small eager calls), plain PyTorch elsewhere; casting
        modes "none", "gemma", "llama", offset 0 or 1 (Gemma's 1 + weight), weight=None.
    fused_add_rms_norm(x, residual, weight, eps=1e-5, ...) -> (y, x + residual): the
        residual add and the norm in one pass each way.
    RMSNorm, FusedAddRMSNorm: the nn.Modules.
    replace_rms_norms(model): swap torch.nn.RMSNorm and Hugging Face RMSNorms in place.
    RMSNormFunction, FusedAddRMSNormFunction: the autograd.Functions over the kernels
        (without Triton, their ``apply`` raises an ImportError saying what to install).
    RMSNormTorchFunction: RMSNorm in plain PyTorch with a hand-derived backward.
    rms_norm_backward_x, rms_norm_backward_weight: closed-form gradients.
    OPTIONS (in tritonnorm.ops, defined in tritonnorm.options): which path a call takes.

Modules: ``ops`` (the operator: entry points, dispatch rule, autograd.Functions),
``kernels`` (the Triton kernels), ``options`` (``OPTIONS``), ``reference`` (plain PyTorch
and the argument rules), ``nn`` (the modules and ``replace_rms_norms``), ``limits`` (eps's
range without torch). Internal: ``_host`` (the host functions: pick a kernel and its
configuration, allocate, launch), ``_launch`` (the kernels' arguments by name, Triton's
launch), ``_tuning`` (launch configurations), ``_machinery`` (what cuts an eager call's host
time), ``_library`` (the ``torch.ops.tritonnorm`` operators).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.10.0"

# Every name is imported on first use (PEP 562): `import tritonnorm` alone loads neither
# torch nor triton, so that a command line importing it answers `--help` at once.
_EXPORTS = {
    "HAS_TRITON": "ops", "FusedAddRMSNormFunction": "ops", "RMSNormFunction": "ops",
    "fused_add_rms_norm": "ops", "rms_norm": "ops",
    "FusedAddRMSNorm": "nn", "RMSNorm": "nn", "replace_rms_norms": "nn",
    "RMSNormTorchFunction": "reference", "rms_norm_backward_weight": "reference",
    "rms_norm_backward_x": "reference", "rms_norm_reference": "reference",
}

if TYPE_CHECKING:
    from tritonnorm.nn import FusedAddRMSNorm, RMSNorm, replace_rms_norms
    from tritonnorm.ops import (
        HAS_TRITON,
        FusedAddRMSNormFunction,
        RMSNormFunction,
        fused_add_rms_norm,
        rms_norm,
    )
    from tritonnorm.reference import (
        RMSNormTorchFunction,
        rms_norm_backward_weight,
        rms_norm_backward_x,
        rms_norm_reference,
    )


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tritonnorm' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tritonnorm.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


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
