"""Closed-form gradients and the plain-PyTorch Function against float64 autograd."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lab2_testing.tn_numerics import TOL, dx_scale, random_inputs, reference_grads, rel_err
from tritonnorm import (
    RMSNormTorchFunction,
    rms_norm,
    rms_norm_backward_weight,
    rms_norm_backward_x,
    rms_norm_reference,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
shapes = st.lists(st.integers(1, 5), min_size=0, max_size=2).flatmap(
    lambda lead: st.integers(1, 300).map(lambda h: (*lead, h))
)


@given(
    shape=shapes,
    dtype=st.sampled_from(DTYPES),
    w32=st.booleans(),
    eps=st.sampled_from([0.0, 1e-6, 1e-5, 1e-2]),
    scale=st.sampled_from([1e-2, 1.0, 30.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_closed_forms_and_function_match_float64(shape, dtype, w32, eps, scale, seed):
    wdtype = torch.float32 if w32 else dtype
    x, w, dy = random_inputs(shape, dtype, wdtype, seed=seed, scale=scale, offset=0.1)
    y_ref, dx_ref, dw_ref = reference_grads(x, w, dy, eps)
    dx = rms_norm_backward_x(dy, x, w, eps)
    dw = rms_norm_backward_weight(dy, x, w, eps)
    assert dx.dtype == dtype and dw.dtype == wdtype and dx.shape == x.shape
    assert rel_err(dx, dx_ref, dx_scale(x, w, dy, eps)) < TOL[dtype]
    assert rel_err(dw, dw_ref) < TOL[wdtype]

    xa = x.clone().requires_grad_()
    wa = w.clone().requires_grad_()
    y = RMSNormTorchFunction.apply(xa, wa, eps)
    dy_before = dy.clone()
    y.backward(dy)
    assert torch.equal(dy, dy_before), "backward wrote into grad_output"
    assert y.dtype == dtype and y.shape == x.shape
    assert rel_err(y, y_ref) < TOL[dtype]
    assert rel_err(xa.grad, dx_ref, dx_scale(x, w, dy, eps)) < TOL[dtype]
    assert rel_err(wa.grad, dw_ref) < TOL[wdtype]


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(0)
    for shape in [(3, 5), (2, 3, 7), (4, 1)]:
        x = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
        w = torch.randn(shape[-1], generator=g, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda a, b: RMSNormTorchFunction.apply(a, b, 1e-5),
                                        (x, w))


def test_backward_skips_unneeded_gradients():
    x, w, dy = random_inputs((4, 16), torch.float32, torch.float32, seed=1)
    xa = x.clone().requires_grad_()
    RMSNormTorchFunction.apply(xa, w, 1e-5).backward(dy)  # weight needs no grad
    assert w.grad is None and xa.grad is not None
    wa = w.clone().requires_grad_()
    RMSNormTorchFunction.apply(x, wa, 1e-5).backward(dy)  # x needs no grad
    assert x.grad is None and wa.grad is not None


@given(
    shape=shapes,
    dtype=st.sampled_from([torch.float32, torch.float64]),
    c=st.floats(1e-3, 1e3),
    eps=st.sampled_from([0.0, 1e-5, 1e-2]),
    seed=st.integers(0, 2**31 - 1),
)
def test_scale_invariance(shape, dtype, c, eps, seed):
    # x / sqrt(mean(x^2) + eps) is unchanged by x -> c x, eps -> c^2 eps (exactly, c > 0).
    x, w, _ = random_inputs(shape, dtype, dtype, seed=seed, offset=0.1)
    y1 = rms_norm(x, w, eps)
    y2 = rms_norm(x * c, w, eps * c * c)
    assert rel_err(y2, y1) < 10 * TOL[dtype]


@given(
    shape=shapes,
    g=st.floats(-5, 5).filter(lambda v: abs(v) > 1e-3),
    eps=st.sampled_from([0.0, 1e-5, 1e-1]),
    seed=st.integers(0, 2**31 - 1),
)
def test_output_rms_equals_abs_gain(shape, g, eps, seed):
    # With a constant gain g each output row has RMS |g| * sqrt(ms / (ms + eps)).
    x, _, _ = random_inputs(shape, torch.float32, torch.float32, seed=seed, offset=0.1)
    w = torch.full((shape[-1],), g)
    y = rms_norm(x, w, eps).double()
    ms = x.double().pow(2).mean(-1)
    expect = abs(g) * torch.sqrt(ms / (ms + eps))
    assert rel_err(y.pow(2).mean(-1).sqrt(), expect) < 1e-5


@given(shape=shapes, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1))
def test_agrees_with_torch_rms_norm(shape, dtype, seed):
    f_rms_norm = getattr(torch.nn.functional, "rms_norm", None)
    if f_rms_norm is None:
        pytest.skip("torch.nn.functional.rms_norm needs PyTorch 2.4")
    x, w, _ = random_inputs(shape, torch.float32, torch.float32, seed=seed, offset=0.1)
    ours = rms_norm_reference(x, w, 1e-5)
    theirs = f_rms_norm(x, (shape[-1],), w, 1e-5)
    assert rel_err(ours, theirs) < TOL[torch.float32]


def test_zero_rows():
    x = torch.randn(0, 3, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    y = RMSNormTorchFunction.apply(x, w, 1e-5)
    assert y.shape == (0, 3, 8)
    y.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(w.grad, torch.zeros(8))


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, w: rms_norm(x, w),
        lambda x, w: RMSNormTorchFunction.apply(x, w, 1e-5),
        lambda x, w: rms_norm_backward_x(torch.ones_like(x), x, w),
        lambda x, w: rms_norm_backward_weight(torch.ones_like(x), x, w),
    ],
    ids=["rms_norm", "torch_function", "backward_x", "backward_weight"],
)
def test_validation_errors(fn):
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"\(7,\).*\(4, 8\).*\(8,\)"):
        fn(x, torch.ones(7))
    with pytest.raises(ValueError, match=r"\(8, 1\)"):
        fn(x, torch.ones(8, 1))
    with pytest.raises(TypeError, match="floating-point"):
        fn(x.to(torch.int64), torch.ones(8))
    with pytest.raises(TypeError, match="floating-point"):
        fn(x, torch.ones(8, dtype=torch.int32))


def test_bad_eps_and_grad_shape():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, torch.ones(8), -1.0)
    with pytest.raises(ValueError, match=">= 1"):
        rms_norm(torch.randn(4, 0), torch.ones(0))
    with pytest.raises(ValueError, match="scalar"):
        rms_norm(torch.tensor(1.0), torch.ones(1))
    with pytest.raises(ValueError, match="grad_output"):
        rms_norm_backward_x(torch.ones(4, 7), x, torch.ones(8))
