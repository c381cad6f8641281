"""Numerics helpers for the RMSNorm tests: the reference formula, float64 oracles and
per-dtype tolerances."""

from __future__ import annotations

import torch

# Norm-relative error allowed against a float64 reference, by the dtype of the result.
# float32 math everywhere; the half-precision bounds are a few units of their rounding.
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float64: 1e-12}


def rel_err(out: torch.Tensor, ref: torch.Tensor, scale: float | None = None) -> float:
    """||out - ref|| / ||ref|| in float64 (or / ``scale`` when that is larger).

    ``scale`` is for results that are a difference of larger terms (dx is
    r * (g * dy - x_hat * c)): their rounding error scales with the terms, not the result.
    """
    diff = (out.double() - ref.double()).norm().item()
    den = max(ref.double().norm().item(), scale or 0.0)
    assert den > 0, "reference is all zeros: the test would prove nothing"
    assert torch.isfinite(out).all(), "non-finite values in the result"
    return diff / den


def inv_rms(x, eps, dtype=torch.float64):
    """r = rsqrt(mean(x^2) + eps) over the last dimension, computed in ``dtype``."""
    x = x.to(dtype)
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_ref(x, weight=None, eps=1e-5, dtype=torch.float64):
    """RMSNorm as the tests write it: x * r * weight in ``dtype`` (float64 unless asked
    otherwise), ``r`` from ``inv_rms``; no weight when ``weight`` is None. Differentiable,
    and the result stays in ``dtype``."""
    x = x.to(dtype)
    y = x * inv_rms(x, eps, dtype)
    return y if weight is None else y * weight.to(dtype)


def reference_grads(x, weight, grad_output, eps):
    """(y, dx, dweight) by autograd through the float64 formula: an oracle independent of
    the hand-derived backward."""
    xr = x.detach().double().requires_grad_()
    wr = weight.detach().double().requires_grad_()
    y = rms_norm_ref(xr, wr, eps)
    y.backward(grad_output.detach().double())
    return y.detach(), xr.grad, wr.grad


def dx_scale(x, weight, grad_output, eps) -> float:
    """Size of the larger term of dx, r * g * dy, as a float64 norm."""
    r = inv_rms(x.detach(), eps)
    return (r * weight.detach().double() * grad_output.detach().double()).norm().item()


def random_inputs(shape, dtype, wdtype, *, seed, device="cpu", scale=1.0, offset=0.0):
    """Fresh random x, weight and grad_output (never zeros) from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    h = shape[-1]
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * scale + offset).to(dtype)
    w = (1.0 + 0.5 * torch.randn(h, generator=g, dtype=torch.float64)).to(wdtype)
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return x.to(device), w.to(device), dy.to(device)
