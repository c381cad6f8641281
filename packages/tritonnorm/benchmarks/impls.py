"""The RMSNorm implementations that ``kernel_table.py`` and ``host_time.py`` put side by side.

``ALL[name](w, b)`` checks that the implementation can run on the weight's device and
returns ``(x, w, b) -> y`` (the bias is LayerNorm's), or raises ``Unavailable`` saying why
it cannot. Liger-Kernel is imported only when asked for.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

import tritonnorm
from tritonnorm.ops import OPTIONS

EPS = 1e-5
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Left out of ``--quick`` unless named with ``--impl``: setting them up takes long.
SLOW_SETUP = ("compile-naive",)


class Unavailable(RuntimeError):
    """This implementation cannot run here (library missing, wrong device...)."""


def naive(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The formula in eager PyTorch, computed in float32, returned in x's dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)


def _triton(w, b):
    if w.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise Unavailable("Triton kernels need a CUDA device (or TRITON_INTERPRET=1)")
    return lambda x, w, b: tritonnorm.RMSNormFunction.apply(x, w, EPS)


def _compiled(w, b):
    # A fresh compilation per shape: one compiled function reused over many shapes would
    # hit dynamo's recompile limit and silently fall back to eager.
    torch._dynamo.reset()
    compiled = torch.compile(naive, dynamic=False)
    return lambda x, w, b: compiled(x, w)


def _liger(w, b):
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError:
        raise Unavailable("Liger-Kernel is not installed (pip install liger-kernel)") from None
    if w.device.type != "cuda":
        raise Unavailable("Liger-Kernel needs a CUDA device")
    # Positional (X, W, eps, offset, casting_mode): "llama" casting computes in float32.
    return lambda x, w, b: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama")


IMPLS = {
    "torch-naive": lambda w, b: lambda x, w, b: naive(x, w),
    # Hand-written backward in plain PyTorch.
    "tritonnorm-torch": lambda w, b: lambda x, w, b: tritonnorm.RMSNormTorchFunction.apply(
        x, w, EPS),
    "tritonnorm": _triton,  # RMSNormFunction: the Triton kernels
    # The entry point tritonnorm.RMSNorm calls: the kernels on CUDA (the eager dispatch
    # aside), RMSNormTorchFunction elsewhere. Only its host path differs from
    # "tritonnorm", so kernel_table.py runs it only when named.
    "tritonnorm.rms_norm": lambda w, b: lambda x, w, b: tritonnorm.rms_norm(x, w, EPS),
    "compile-naive": _compiled,
    "F.rms_norm": lambda w, b: lambda x, w, b: F.rms_norm(x, x.shape[-1:], w, EPS),
    # LayerNorm computes something else (its error is checked against LayerNorm): for scale.
    "F.layer_norm": lambda w, b: lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, EPS),
    "liger": _liger,
}


def _forced(path: str, mode: str, offset: float, weight: bool):
    def fn(x, w, b):
        with OPTIONS.override(eager_dispatch=path):
            return tritonnorm.rms_norm(x, w if weight else None, EPS, casting_mode=mode,
                                       offset=offset)
    return lambda w, b: fn


#: ``kernel_table.py --crossover``: name -> (casting mode, offset, has a weight).
VARIANTS = {"plain": ("none", 0.0, True), "gemma": ("gemma", 1.0, True),
            "no-weight": ("none", 0.0, False)}
#: tritonnorm.rms_norm per variant with its eager path forced: the Triton kernels or F.rms_norm.
CROSSOVER = {f"{name}/{v}": _forced(path, *VARIANTS[v]) for v in VARIANTS
             for path, name in (("kernels", "kernels"), ("torch", "F.rms_norm"))}
#: Implementations from tritonnorm; the others are the alternatives they are compared to.
OURS = ("tritonnorm", "tritonnorm-torch", "tritonnorm.rms_norm", *CROSSOVER)
#: Every name ``--impl`` takes.
ALL = IMPLS | CROSSOVER


def comma_list(choices=None):
    """An argparse type: comma-separated values, in order, each once; names among
    ``choices``, or positive integers without ``choices`` (``--hidden 1024,2048``)."""

    def parse(text: str) -> list:
        values = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
        if choices is None:
            values = [int(v) for v in values]
        if not values or any(v not in choices if choices else v < 1 for v in values):
            use = ", ".join(choices or ["positive integers"])
            raise argparse.ArgumentTypeError(f"{text!r}: use {use}")
        return values

    return parse


parse_impls, parse_dtypes = comma_list(ALL), comma_list(DTYPES)
parse_ints = comma_list()


def short(err: BaseException, limit: int = 300) -> str:
    """An exception as one line of at most ``limit`` characters."""
    text = f"{type(err).__name__}: " + " ".join(str(err).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
