"""fused_add_rms_norm: the residual add and the norm in one pass, against float64.

The kernels run on CUDA, or on the CPU under TRITON_INTERPRET=1 (marked ``triton``); the
plain-PyTorch path (CPU tensors through ``fused_add_rms_norm``) runs everywhere.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonnorm
from lab2_testing.tn_numerics import TOL, rel_err, rms_norm_ref
from tritonnorm import FusedAddRMSNorm, FusedAddRMSNormFunction, fused_add_rms_norm

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(shape, x_dtype, r_dtype, w_dtype, seed, device):
    """Fresh random x, residual, weight and the two incoming gradients (never zeros)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(s, dtype, scale=1.0, offset=0.0):
        return (torch.randn(s, generator=g, dtype=torch.float64) * scale + offset).to(dtype)

    h = shape[-1]
    x = rnd(shape, x_dtype, offset=0.1).to(device)
    r = rnd(shape, r_dtype, scale=0.5).to(device)
    w = rnd((h,), w_dtype, scale=0.5, offset=1.0).to(device)
    dy = rnd(shape, x_dtype).to(device)
    ds = rnd(shape, x_dtype).to(device)
    return x, r, w, dy, ds


def _reference(s, w, dy, ds, eps):
    """(y, d(sum), dweight) by float64 autograd from the rounded sum: the oracle."""
    s64 = s.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    y = rms_norm_ref(s64, w64, eps)
    (y * dy.double()).sum().add((s64 * ds.double()).sum()).backward()
    return y.detach(), s64.grad, w64.grad


def _check(fn, x, r, w, dy, ds, eps=1e-5):
    xa, ra, wa = (t.clone().requires_grad_() for t in (x, r, w))
    before = [t.clone() for t in (x, r, w, dy, ds)]
    y, s = fn(xa, ra, wa, eps)
    torch.autograd.backward((y, s), (dy, ds))
    for t, b in zip((x, r, w, dy, ds), before):
        assert torch.equal(t, b), "an input was modified"
    # The sum lands in x's dtype, exactly as PyTorch rounds it on the GPU (Triton's
    # interpreter may round float32 to bfloat16 the other way at a tie).
    assert s.dtype == x.dtype and y.dtype == x.dtype and s.shape == x.shape
    s_torch = (x.float() + r.float()).to(x.dtype)
    assert torch.equal(s, s_torch) if s.is_cuda else rel_err(s, s_torch) < TOL[x.dtype]
    y_ref, d_ref, dw_ref = _reference(s, w, dy, ds, eps)
    assert rel_err(y, y_ref) < TOL[x.dtype]
    # x and residual get the same gradient, each in its own dtype.
    assert xa.grad.dtype == x.dtype and ra.grad.dtype == r.dtype and wa.grad.dtype == w.dtype
    assert rel_err(xa.grad, d_ref) < TOL[x.dtype]
    assert rel_err(ra.grad, d_ref) < max(TOL[x.dtype], TOL[r.dtype])
    assert rel_err(wa.grad, dw_ref) < max(TOL[w.dtype], TOL[x.dtype])
    return y, s, xa.grad, ra.grad, wa.grad


def _kernel_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.triton
@settings(deadline=None)
@given(rows=st.integers(1, 24), cols=st.integers(1, 300), x_dtype=st.sampled_from(DTYPES),
       r_dtype=st.sampled_from(DTYPES), w_dtype=st.sampled_from(DTYPES),
       lead=st.sampled_from([(), (2,)]), seed=st.integers(0, 2**16))
def test_kernels_match_float64(rows, cols, x_dtype, r_dtype, w_dtype, lead, seed):
    x, r, w, dy, ds = _inputs((*lead, rows, cols), x_dtype, r_dtype, w_dtype, seed,
                              _kernel_device())
    _check(FusedAddRMSNormFunction.apply, x, r, w, dy, ds)


@pytest.mark.triton
def test_kernels_are_deterministic(kernel_device):
    x, r, w, dy, ds = _inputs((37, 200), torch.bfloat16, torch.bfloat16, torch.float32, 3,
                              kernel_device)
    a = _check(FusedAddRMSNormFunction.apply, x, r, w, dy, ds)
    b = _check(FusedAddRMSNormFunction.apply, x, r, w, dy, ds)
    assert all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_long_rows(kernel_device, dtype):
    # Rows longer than one block: the add runs apart, then the long-row kernels.
    from tritonnorm import _tuning

    x, r, w, dy, ds = _inputs((9, 100), dtype, torch.float32, torch.float32, 5, kernel_device)
    with _tuning.override(max_fused_block_fwd=16, max_fused_block_bwd=16, loop_chunk=32,
                          loop_chunk_bwd=32):
        _check(FusedAddRMSNormFunction.apply, x, r, w, dy, ds)


@pytest.mark.triton
def test_only_weight_or_only_inputs_need_grad(kernel_device):
    x, r, w, dy, ds = _inputs((6, 48), torch.float32, torch.float32, torch.float32, 8,
                              kernel_device)
    wa = w.clone().requires_grad_()
    y, s = FusedAddRMSNormFunction.apply(x, r, wa, 1e-5)
    torch.autograd.backward((y, s), (dy, ds))
    assert wa.grad is not None and rel_err(wa.grad, _reference(s, w, dy, ds, 1e-5)[2]) < 1e-5
    xa = x.clone().requires_grad_()
    y, _ = FusedAddRMSNormFunction.apply(xa, r, w, 1e-5)
    y.backward(dy)  # the sum unused: its gradient is zero
    assert rel_err(xa.grad, _reference(s, w, dy, torch.zeros_like(ds), 1e-5)[1]) < 1e-5


@pytest.mark.triton
def test_kernels_reject_mismatched_residual(kernel_device):
    x, r, w, _, _ = _inputs((4, 32), torch.float32, torch.float32, torch.float32, 1,
                            kernel_device)
    # A valid call first: on CUDA it records a launch plan for this shape, which a call
    # with a residual elsewhere must not reuse (the launch takes bare addresses).
    FusedAddRMSNormFunction.apply(x, r, w, 1e-5)
    with pytest.raises(ValueError, match="residual"):
        FusedAddRMSNormFunction.apply(x, r[:, :16], w, 1e-5)
    with pytest.raises(ValueError, match="residual"):
        FusedAddRMSNormFunction.apply(x, r.to("meta"), w, 1e-5)
    with pytest.raises(ValueError, match="residual"):
        FusedAddRMSNormFunction.apply(x, r.cpu() if x.is_cuda else r.to("meta"), w, 1e-5)


@pytest.mark.triton
def test_only_the_sum_is_used(kernel_device):
    # y unused: its gradient comes as None, and the sum's gradient passes to x and the
    # residual unchanged (in each one's dtype); the weight gets none.
    x, r, w, _, ds = _inputs((2, 5, 40), torch.bfloat16, torch.float32, torch.float32, 4,
                             kernel_device)
    xa, ra, wa = (t.clone().requires_grad_() for t in (x, r, w))
    _, s = FusedAddRMSNormFunction.apply(xa, ra, wa, 1e-5)
    s.backward(ds)
    assert torch.equal(xa.grad, ds) and ra.grad.dtype == torch.float32
    assert torch.equal(ra.grad, ds.float()) and wa.grad is None


@settings(deadline=None)
@given(x_dtype=st.sampled_from([torch.float64, *DTYPES]),
       r_dtype=st.sampled_from([torch.float64, *DTYPES]), seed=st.integers(0, 2**16))
def test_torch_path_matches_float64(x_dtype, r_dtype, seed):
    # CPU tensors take plain PyTorch through the public function.
    x, r, w, dy, ds = _inputs((5, 3, 40), x_dtype, r_dtype, torch.float32, seed, "cpu")
    tol = {**TOL, torch.float64: 1e-10}
    xa, ra, wa = (t.clone().requires_grad_() for t in (x, r, w))
    y, s = fused_add_rms_norm(xa, ra, wa)
    torch.autograd.backward((y, s), (dy, ds))
    assert s.dtype == x.dtype and torch.equal(s, (x.double() + r.double()).to(x.dtype)) or (
        torch.equal(s, (x.float() + r.float()).to(x.dtype)))
    y_ref, d_ref, dw_ref = _reference(s, w, dy, ds, 1e-5)
    assert rel_err(y, y_ref) < tol[x_dtype]
    assert rel_err(xa.grad, d_ref) < tol[x_dtype]
    assert ra.grad.dtype == r.dtype and rel_err(ra.grad, d_ref) < max(tol[x_dtype],
                                                                        tol[r_dtype])
    assert rel_err(wa.grad, dw_ref) < max(tol[x_dtype], 2e-5)


def test_bad_input_is_refused_before_any_work():
    x = torch.randn(4, 8)
    w = torch.ones(8)
    with pytest.raises(ValueError, match="residual has shape"):
        fused_add_rms_norm(x, torch.randn(4, 9), w)
    with pytest.raises(ValueError, match="residual has shape"):
        fused_add_rms_norm(x, torch.randn(8), w)  # broadcasting is not adding in place
    with pytest.raises(TypeError, match="residual"):
        fused_add_rms_norm(x, torch.ones(4, 8, dtype=torch.int64), w)
    with pytest.raises(TypeError, match="residual"):
        fused_add_rms_norm(x, [1.0] * 8, w)
    with pytest.raises(ValueError, match="weight"):
        fused_add_rms_norm(x, torch.randn(4, 8), torch.ones(7))


def test_module_form_and_state_dict():
    torch.manual_seed(0)
    m = FusedAddRMSNorm(16, eps=1e-6)
    with torch.no_grad():
        m.weight.normal_(1.0, 0.2)
    plain = tritonnorm.RMSNorm(16, eps=1e-6)
    plain.load_state_dict(m.state_dict())
    x, r = torch.randn(3, 16), torch.randn(3, 16)
    y, s = m(x, r)
    assert torch.equal(s, x + r)
    assert rel_err(y, plain(x + r)) < 1e-6


@pytest.mark.triton
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_out_dtype_writes_y_in_that_dtype(kernel_device, out_dtype):
    # y written in another dtype (what a following autocast layer would cast it to):
    # the same numbers as the float32 y, rounded once; gradients arrive in that dtype.
    from tritonnorm import RMSNormFunction

    x, r, w, _, ds = _inputs((12, 96), torch.float32, torch.bfloat16, torch.float32, 6,
                             kernel_device)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(out_dtype)
    dy = dy.to(kernel_device)
    xa, ra, wa = (t.clone().requires_grad_() for t in (x, r, w))
    y, s = FusedAddRMSNormFunction.apply(xa, ra, wa, 1e-5, out_dtype)
    assert y.dtype == out_dtype and s.dtype == x.dtype
    torch.autograd.backward((y, s), (dy, ds))
    y_ref, d_ref, dw_ref = _reference(s, w, dy, ds, 1e-5)
    assert rel_err(y, y_ref) < TOL[out_dtype]
    assert rel_err(xa.grad, d_ref) < TOL[torch.float32]
    assert rel_err(wa.grad, dw_ref) < TOL[torch.float32]
    xb = x.clone().requires_grad_()
    y2 = RMSNormFunction.apply(xb, w, 1e-5, out_dtype)
    y2.backward(dy)
    y_ref, d_ref, _ = _reference(x, w, dy, torch.zeros_like(ds), 1e-5)
    assert y2.dtype == out_dtype and rel_err(y2, y_ref) < TOL[out_dtype]
    assert rel_err(xb.grad, d_ref) < TOL[torch.float32]


def test_out_dtype_on_the_torch_path():
    x, r, w = torch.randn(3, 8), torch.randn(3, 8), torch.rand(8) + 0.5
    y, s = fused_add_rms_norm(x, r, w, out_dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert torch.equal(y, tritonnorm.rms_norm(x + r, w).to(torch.bfloat16))
    assert tritonnorm.rms_norm(x, w, out_dtype=torch.float16).dtype == torch.float16
