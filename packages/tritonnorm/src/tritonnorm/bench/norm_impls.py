"""The RMSNorm implementations the ``norm`` and ``norm-host`` suites put side by side.

Each implementation's ``prepare`` takes the weight (and bias, used by LayerNorm), checks
that it can run on their device, and returns a callable ``(x, weight, bias) -> y``, or
raises ``Unavailable`` saying why it cannot run here; ``Impl.make(w, b)`` binds the two
tensors and returns ``x -> y``. (``norm-host`` calls the unbound form with a fresh weight
leaf per call, as in a model where every norm has its own weight.) Optional libraries
(tritonnorm, Liger-Kernel) are imported only when asked for.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where used, so that `lab2bench --help` skips it
    import torch

EPS = 1e-5
NormFn = Callable[["torch.Tensor"], "torch.Tensor"]
#: ``(x, weight, bias) -> y``; the bias is used by LayerNorm only.
NormFn3 = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor"], "torch.Tensor"]


class Unavailable(RuntimeError):
    """This implementation cannot run here (library missing, wrong device...)."""


def rms_norm_naive(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """The formula in eager PyTorch, computed in float32, returned in x's dtype."""
    import torch

    x32 = x.float()
    inv_rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (x32 * inv_rms * weight.float()).to(x.dtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """float64 reference for the correctness check."""
    import torch

    x64, w64 = x.double(), weight.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(dim=-1, keepdim=True) + eps) * w64


@dataclass(frozen=True)
class Impl:
    """One implementation: its name, what it computes, and how to make it."""

    name: str
    description: str
    #: ``prepare(w, b)``: check that it runs on w's device (``Unavailable`` if not) and
    #: return ``(x, w, b) -> y``.
    prepare: Callable[[torch.Tensor, torch.Tensor], NormFn3]
    #: LayerNorm computes something else; its error is checked against LayerNorm.
    is_rms: bool = True
    #: Left out of ``--quick`` unless named with ``--impl`` (too slow to set up there).
    slow_setup: bool = False
    #: Run by the ``norm`` suite when no ``--impl`` is given. (``tritonnorm.rms_norm``
    #: launches the same kernels as ``tritonnorm``; only its host path differs, which
    #: is ``norm-host``'s subject.)
    in_norm_default: bool = True

    def make(self, w: torch.Tensor, b: torch.Tensor) -> NormFn:
        """The implementation with its weight and bias bound: ``x -> y``."""
        fn = self.prepare(w, b)
        return lambda x: fn(x, w, b)


def _make_naive(w: torch.Tensor, b: torch.Tensor) -> NormFn3:
    return lambda x, w, b: rms_norm_naive(x, w)


def _tritonnorm():
    try:
        import tritonnorm
    except ImportError:
        raise Unavailable("tritonnorm is not installed (pip install tritonnorm[bench])") from None
    return tritonnorm


def _make_tritonnorm_torch(w: torch.Tensor, b: torch.Tensor) -> NormFn3:
    fn = getattr(_tritonnorm(), "RMSNormTorchFunction", None)
    if fn is None:
        raise Unavailable("this tritonnorm has no RMSNormTorchFunction")
    return lambda x, w, b: fn.apply(x, w, EPS)


def _make_tritonnorm_triton(w: torch.Tensor, b: torch.Tensor) -> NormFn3:
    if w.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise Unavailable("Triton kernels need a CUDA device (or TRITON_INTERPRET=1)")
    fn = getattr(_tritonnorm(), "RMSNormFunction", None)
    if fn is None:
        raise Unavailable("this tritonnorm has no RMSNormFunction")
    return lambda x, w, b: fn.apply(x, w, EPS)


def _make_tritonnorm_api(w: torch.Tensor, b: torch.Tensor) -> NormFn3:
    # What tritonnorm.RMSNorm (and so the trainer's model) calls: the Triton kernels on
    # CUDA, RMSNormTorchFunction elsewhere; without autograd recording, the forward kernel
    # alone.
    rms_norm = _tritonnorm().rms_norm
    return lambda x, w, b: rms_norm(x, w, EPS)


def _make_compiled(w: torch.Tensor, b: torch.Tensor) -> NormFn3:
    import torch

    if not hasattr(torch, "compile"):
        raise Unavailable("torch.compile is not available")
    # A fresh compilation per shape: one compiled function reused over many shapes
    # would hit dynamo's recompile limit and silently fall back to eager.
    torch._dynamo.reset()
    compiled = torch.compile(rms_norm_naive, dynamic=False)
    return lambda x, w, b: compiled(x, w)


def _make_f_rms_norm(w: torch.Tensor, b: torch.Tensor) -> NormFn3:
    import torch
    import torch.nn.functional as F

    if not hasattr(F, "rms_norm"):
        raise Unavailable(f"torch {torch.__version__} has no torch.nn.functional.rms_norm")
    shape = (w.shape[0],)
    return lambda x, w, b: F.rms_norm(x, shape, w, EPS)


def _make_layer_norm(w: torch.Tensor, b: torch.Tensor) -> NormFn3:
    import torch.nn.functional as F

    shape = (w.shape[0],)
    return lambda x, w, b: F.layer_norm(x, shape, w, b, EPS)


def _make_liger(w: torch.Tensor, b: torch.Tensor) -> NormFn3:
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError:
        raise Unavailable("Liger-Kernel is not installed (pip install liger-kernel)") from None
    if w.device.type != "cuda":
        raise Unavailable("Liger-Kernel needs a CUDA device")
    # Positional: (X, W, eps, offset, casting_mode); the later in_place flag keeps its
    # default across versions. "llama" casting computes in float32.
    return lambda x, w, b: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama")


IMPLS: dict[str, Impl] = {
    impl.name: impl
    for impl in (
        Impl("torch-naive", "the formula in eager PyTorch, fp32 math", _make_naive),
        Impl("tritonnorm-torch", "tritonnorm.RMSNormTorchFunction (hand-written backward)",
             _make_tritonnorm_torch),
        Impl("tritonnorm", "tritonnorm.RMSNormFunction (Triton kernels)", _make_tritonnorm_triton),
        Impl("tritonnorm.rms_norm", "tritonnorm.rms_norm, the entry point tritonnorm.RMSNorm "
             "calls (Triton kernels on CUDA, RMSNormTorchFunction elsewhere)",
             _make_tritonnorm_api, in_norm_default=False),
        Impl("compile-naive", "torch.compile of torch-naive", _make_compiled, slow_setup=True),
        Impl("F.rms_norm", "torch.nn.functional.rms_norm", _make_f_rms_norm),
        Impl("F.layer_norm", "torch.nn.functional.layer_norm (LayerNorm, for scale)",
             _make_layer_norm, is_rms=False),
        Impl("liger", "Liger-Kernel's LigerRMSNormFunction", _make_liger),
    )
}
#: Implementations from tritonnorm; the others are the alternatives they are compared to.
OURS = ("tritonnorm", "tritonnorm-torch", "tritonnorm.rms_norm")


def default_impls(quick: bool, *, norm_suite_only: bool = False) -> tuple[list[str], list[str]]:
    """The implementations a suite runs when none is named, and a note on each left out
    of ``--quick`` (``norm_suite_only``: those the ``norm`` suite runs by default)."""
    names, notes = [], []
    for name, impl in IMPLS.items():
        if norm_suite_only and not impl.in_norm_default:
            continue
        if quick and impl.slow_setup:
            notes.append(f"{name}: left out of --quick (setting it up takes long); "
                         f"ask for it with --impl {name}")
            continue
        names.append(name)
    return names, notes
