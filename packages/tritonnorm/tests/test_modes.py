"""Casting modes ("none", "gemma", "llama"), the offset (Gemma's 1 + weight) and weight=None:
every path against the float64 reference of each mode, in every dtype, both gradients.

The kernels' tests are marked ``triton`` (CUDA, or the CPU under TRITON_INTERPRET=1, where
the interpreter is slow: small shapes only); the plain-PyTorch and ``F.rms_norm`` paths run
anywhere.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tritonnorm
from lab2_testing.tn_numerics import TOL, rel_err
from tritonnorm import (
    FusedAddRMSNorm,
    FusedAddRMSNormFunction,
    RMSNorm,
    RMSNormFunction,
    RMSNormTorchFunction,
    _host,
    _library,
    _tuning,
    fused_add_rms_norm,
    ops,
    rms_norm,
)
from tritonnorm.reference import rms_norm_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
#: (casting_mode, offset) of every variant the Hugging Face families use, and llama + 1.
VARIANTS = [("none", 0.0), ("gemma", 1.0), ("llama", 0.0), ("llama", 1.0), ("gemma", 0.0)]
EPS = 1e-5


def _inputs(shape, dtype, wdtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    w = None if wdtype is None else (
        0.5 * torch.randn(shape[-1], generator=g, dtype=torch.float64)).to(wdtype)
    dy = torch.randn(shape, generator=g, dtype=torch.float64)
    return x.to(device), None if w is None else w.to(device), dy.to(device)


def _reference(x, w, dy, mode, offset):
    """(y, dx, dweight) in float64 by autograd through the float64 reference of the mode
    (whose "llama" rounding still rounds x_hat to x's dtype)."""
    xr = x.detach().cpu().requires_grad_()
    wr = None if w is None else w.detach().cpu().requires_grad_()
    y = rms_norm_reference(xr, wr, EPS, casting_mode=mode, offset=offset,
                           out_dtype=torch.float64, compute_dtype=torch.float64)
    y.backward(dy.cpu())
    return y.detach(), xr.grad, None if wr is None else wr.grad


def _dx_scale(x, w, dy, offset):
    """Size of dx's larger term, r * g * dy (its rounding error scales with it)."""
    xd = x.detach().cpu().double()
    r = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS)
    g = 1.0 if w is None else w.detach().cpu().double() + offset
    return (r * g * dy.cpu()).norm().item()


def _coarser(*dtypes):
    return max(dtypes, key=TOL.__getitem__)


def _check(fn, x, w, dy, mode, offset, expect_dtype=None):
    """Run ``fn(x, w)`` forward and backward and compare y, dx and dweight with the
    float64 reference of the mode, by norm-relative error at the result dtype's
    tolerance. In "llama" mode a result carries the rounding of x_hat to x's dtype (Triton's
    interpreter truncates where the GPU rounds to nearest), so x's tolerance applies too."""
    xa = x.clone().requires_grad_()
    wa = None if w is None else w.clone().requires_grad_()
    y = fn(xa, wa)
    if expect_dtype is not None:
        assert y.dtype == expect_dtype
    dy = dy.to(y.dtype)
    y.backward(dy)
    dy = dy.double()
    y_ref, dx_ref, dw_ref = _reference(x, w, dy, mode, offset)
    rounded = (x.dtype,) if mode == "llama" else ()
    assert rel_err(y.cpu(), y_ref) < TOL[_coarser(y.dtype, *rounded)]
    assert xa.grad.dtype == x.dtype
    assert rel_err(xa.grad.cpu(), dx_ref, _dx_scale(x, w, dy, offset)) < 2 * TOL[x.dtype]
    if w is not None:
        assert wa.grad.dtype == w.dtype
        assert rel_err(wa.grad.cpu(), dw_ref) < 2 * TOL[_coarser(w.dtype, *rounded)]


def _default_dtype(x, w, mode):
    if mode == "llama" and w is not None:
        return torch.promote_types(x.dtype, w.dtype)
    return x.dtype


# ------------------------------------------------------------------ plain PyTorch


@pytest.mark.parametrize("mode, offset", VARIANTS)
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64])
@pytest.mark.parametrize("wkind", ["float32", "same", None])
def test_torch_function_every_variant(mode, offset, dtype, wkind):
    wdtype = None if wkind is None else torch.float32 if wkind == "float32" else dtype
    if wdtype is None and offset:
        pytest.skip("an offset needs a weight")
    x, w, dy = _inputs((3, 5, 24), dtype, wdtype, seed=1)
    _check(lambda a, b: RMSNormTorchFunction.apply(a, b, EPS, None, mode, offset),
           x, w, dy, mode, offset, _default_dtype(x, w, mode))
    # rms_norm on the CPU takes this path too.
    _check(lambda a, b: rms_norm(a, b, EPS, casting_mode=mode, offset=offset),
           x, w, dy, mode, offset, _default_dtype(x, w, mode))


@pytest.mark.parametrize("mode, offset", VARIANTS)
def test_torch_function_gradcheck(mode, offset):
    x, w, _ = _inputs((4, 7), torch.float64, torch.float64, seed=2)
    x.requires_grad_()
    w.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a, b: RMSNormTorchFunction.apply(a, b, EPS, None, mode, offset), (x, w))
    assert torch.autograd.gradcheck(
        lambda a: RMSNormTorchFunction.apply(a, None, EPS, None, mode, 0.0), (x,))


def test_llama_mode_is_hugging_faces_formula():
    # weight * (x.float() * rsqrt(mean(x^2) + eps)).to(input_dtype), bit for bit on the CPU.
    x, w, _ = _inputs((6, 32), torch.bfloat16, torch.bfloat16, seed=3)
    xf = x.float()
    hf = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
    assert torch.equal(rms_norm(x, w, EPS, casting_mode="llama"), hf)
    w32 = w.float()
    hf32 = w32 * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
    out = rms_norm(x, w32, EPS, casting_mode="llama")
    assert out.dtype == torch.float32 and torch.equal(out, hf32)


def test_gemma_mode_is_hugging_faces_formula():
    # (x_hat * (1.0 + weight.float())).type_as(x), in float32 throughout.
    x, w, _ = _inputs((6, 32), torch.bfloat16, torch.bfloat16, seed=4)
    xf = x.float()
    hf = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
          * (1.0 + w.float())).type_as(x)
    assert torch.equal(rms_norm(x, w, EPS, casting_mode="gemma", offset=1.0), hf)


@pytest.mark.parametrize("mode, offset", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_torch_path_matches_the_mode(mode, offset, dtype):
    # The eager dispatch's F.rms_norm path, called as rms_norm would (on the CPU here).
    if ops._F_RMS_NORM is None:
        pytest.skip("no torch.nn.functional.rms_norm")
    for wdtype in (torch.float32, dtype, None):
        if wdtype is None and offset:
            continue
        x, w, dy = _inputs((2, 3, 40), dtype, wdtype, seed=5)
        llama = mode == "llama"
        _check(lambda a, b, llama=llama: ops.torch_rms_norm(a, b, EPS, None, llama, offset),
               x, w, dy, mode, offset, _default_dtype(x, w, mode))


def test_dispatch_rule():
    x = torch.empty(8, 512, dtype=torch.bfloat16)
    with ops.OPTIONS.override(eager_dispatch="kernels"):
        assert not ops._prefer_torch(x)
    with ops.OPTIONS.override(eager_dispatch="torch"):
        assert ops._prefer_torch(x) == (ops._F_RMS_NORM is not None)
    with ops.OPTIONS.override(eager_dispatch="auto"):
        assert not ops._prefer_torch(x)  # 16-bit: the kernels at every measured size
        small = torch.empty(8, 512, dtype=torch.float32)
        assert ops._prefer_torch(small) == ops.HAS_FUSED_TORCH  # host-bound float32
        assert not ops._prefer_torch(torch.empty(0, dtype=torch.float64))  # no threshold
        with ops.OPTIONS.override(torch_below={"torch.bfloat16": 8 * 512 + 1}):
            assert ops._prefer_torch(x) == ops.HAS_FUSED_TORCH
        with ops.OPTIONS.override(torch_below={"torch.bfloat16": 8 * 512}):
            assert not ops._prefer_torch(x)
    with ops.OPTIONS.override(eager_dispatch="fast"), pytest.raises(ValueError, match="auto"):
        ops._prefer_torch(x)


def test_modules_carry_the_mode():
    gemma = RMSNorm(16, 1e-6, casting_mode="gemma", offset=1.0)
    assert torch.equal(gemma.weight, torch.zeros(16))  # Gemma's zero-initialised weight
    assert (gemma.casting_mode, gemma.offset, gemma.eps) == ("gemma", 1.0, 1e-6)
    assert "casting_mode='gemma'" in repr(gemma) and "offset=1.0" in repr(gemma)
    assert list(gemma.state_dict()) == ["weight"]
    x = torch.randn(3, 16)
    assert torch.allclose(gemma(x), rms_norm_reference(x, None, 1e-6))  # 1 + 0 = 1
    free = RMSNorm(16, elementwise_affine=False)
    assert free.weight is None and list(free.state_dict()) == []
    assert torch.allclose(free(x), rms_norm_reference(x, None))
    fused = FusedAddRMSNorm(16, casting_mode="llama")
    y, s = fused(x, x)
    assert torch.allclose(y, rms_norm_reference(2 * x, fused.weight, casting_mode="llama"))
    with pytest.raises(ValueError, match="casting_mode"):
        RMSNorm(16, casting_mode="mistral")
    with pytest.raises(ValueError, match="offset"):
        RMSNorm(16, offset=0.5)
    with pytest.raises(ValueError, match="needs a weight"):
        RMSNorm(16, offset=1.0, elementwise_affine=False)


# ------------------------------------------------------------------ bad input (issue 30)


@pytest.mark.parametrize("bad", [torch.int32, torch.bool, torch.complex64, 5, "float16"])
def test_out_dtype_must_be_a_floating_dtype(bad):
    x, w, _ = _inputs((2, 8), torch.float32, torch.float32, seed=6)
    with pytest.raises(TypeError, match="out_dtype"):
        rms_norm(x, w, out_dtype=bad)
    with pytest.raises(TypeError, match="out_dtype"):
        fused_add_rms_norm(x, x, w, out_dtype=bad)


@pytest.mark.parametrize("bad", ["1e-5", b"1", None, True, torch.tensor(1e-5)])
def test_eps_must_be_a_number(bad):
    x, w, _ = _inputs((2, 8), torch.float32, torch.float32, seed=7)
    with pytest.raises(TypeError, match="eps"):
        rms_norm(x, w, bad)
    with pytest.raises(TypeError, match="eps"):
        fused_add_rms_norm(x, x, w, bad)
    with pytest.raises(TypeError, match="eps"):
        RMSNorm(8, eps=bad)


def test_bad_mode_arguments():
    x, w, _ = _inputs((2, 8), torch.float32, torch.float32, seed=8)
    with pytest.raises(ValueError, match="casting_mode"):
        rms_norm(x, w, casting_mode="LLAMA")
    with pytest.raises(TypeError, match="casting_mode"):
        rms_norm(x, w, casting_mode=None)
    with pytest.raises(ValueError, match="offset"):
        rms_norm(x, w, offset=2.0)
    with pytest.raises(TypeError, match="offset"):
        rms_norm(x, w, offset="1")
    with pytest.raises(ValueError, match="needs a weight"):
        rms_norm(x, None, offset=1.0)


# ------------------------------------------------------------------ the kernels


def _variant_cases():
    return st.tuples(
        st.sampled_from(VARIANTS), st.sampled_from(DTYPES),
        st.sampled_from(["float32", "same", None]),
        st.lists(st.integers(1, 4), min_size=0, max_size=2), st.integers(1, 80),
        st.integers(0, 2**16))


def _wdtype(wkind, dtype):
    return None if wkind is None else torch.float32 if wkind == "float32" else dtype


@pytest.mark.triton
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_variant_cases())
def test_kernels_every_variant_property(kernel_device, case):
    (mode, offset), dtype, wkind, lead, hidden, seed = case
    wdtype = _wdtype(wkind, dtype)
    if wdtype is None:
        offset = 0.0
    x, w, dy = _inputs((*lead, hidden), dtype, wdtype, seed, kernel_device)
    _check(lambda a, b: RMSNormFunction.apply(a, b, EPS, None, mode, offset),
           x, w, dy, mode, offset, _default_dtype(x, w, mode))


@pytest.mark.triton
@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_variant_cases(), st.sampled_from(DTYPES))
def test_fused_add_every_variant_property(kernel_device, case, rdtype):
    (mode, offset), dtype, wkind, lead, hidden, seed = case
    wdtype = _wdtype(wkind, dtype)
    if wdtype is None:
        offset = 0.0
    x, w, dy = _inputs((*lead, hidden), dtype, wdtype, seed, kernel_device)
    r = _inputs((*lead, hidden), rdtype, None, seed + 1, kernel_device)[0]
    xa, ra = x.clone().requires_grad_(), r.clone().requires_grad_()
    wa = None if w is None else w.clone().requires_grad_()
    y, s = FusedAddRMSNormFunction.apply(xa, ra, wa, EPS, None, mode, offset)
    assert s.dtype == dtype and y.dtype == _default_dtype(x, w, mode)
    assert rel_err(s.cpu(), x.double().cpu() + r.double().cpu()) < TOL[dtype]
    dy = dy.to(y.dtype)
    y.backward(dy)
    # The norm's reference starts from the sum the kernel wrote (rounded to x's dtype).
    y_ref, ds_ref, dw_ref = _reference(s.detach(), w, dy.double(), mode, offset)
    rounded = (dtype,) if mode == "llama" else ()
    scale = _dx_scale(s.detach(), w, dy.double(), offset)
    assert rel_err(y.detach().cpu(), y_ref) < TOL[_coarser(y.dtype, *rounded)]
    assert xa.grad.dtype == dtype and ra.grad.dtype == rdtype
    assert rel_err(xa.grad.cpu(), ds_ref, scale) < 2 * TOL[dtype]
    assert rel_err(ra.grad.cpu(), ds_ref, scale) < 2 * TOL[_coarser(dtype, rdtype)]
    if w is not None:
        assert rel_err(wa.grad.cpu(), dw_ref) < 2 * TOL[_coarser(w.dtype, *rounded)]


LONG = dict(max_fused_block_fwd=16, max_fused_block_bwd=16, loop_chunk=32, loop_chunk_bwd=16)


@pytest.mark.triton
@pytest.mark.parametrize("mode, offset", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["looped", "reread", "op"])
def test_every_kernel_path_every_variant(kernel_device, mode, offset, dtype, path):
    # The two-pass long-row kernels (rows made "long" by lowering the fused block), the
    # forward that reads x twice, and the torch.ops operators that compiled code calls.
    for wdtype in (torch.float32, None):
        off = offset if wdtype is not None else 0.0
        x, w, dy = _inputs((5, 70), dtype, wdtype, seed=9, device=kernel_device)
        llama = mode == "llama"
        if path == "looped":
            with _tuning.override(**LONG):
                _check(lambda a, b, o=off: RMSNormFunction.apply(a, b, EPS, None, mode, o),
                       x, w, dy, mode, off)
        elif path == "reread":
            with _tuning.override(chunk=16):
                y, _ = _host.rms_norm_fwd(x, w, EPS, offset=off, llama=llama)
            y_ref = _reference(x, w, dy, mode, off)[0]
            assert rel_err(y.cpu(), y_ref) < TOL[y.dtype]
        else:
            if not _library.HAS_LIBRARY_OPS:
                pytest.skip("no torch.library operators in this PyTorch")
            with ops.OPTIONS.override(eager_op=True, interpret_cpu=True,
                                      eager_dispatch="kernels"):
                _check(lambda a, b, o=off: rms_norm(a, b, EPS, casting_mode=mode, offset=o),
                       x, w, dy, mode, off, _default_dtype(x, w, mode))


@pytest.mark.triton
def test_per_head_4d_input_takes_the_kernels_without_a_copy(kernel_device):
    # Qwen 3's q/k norms: (batch, seq, heads, head_dim) views of a projection's output.
    x, w, dy = _inputs((2, 3, 4, 16), torch.bfloat16, torch.bfloat16, seed=10,
                       device=kernel_device)
    assert _host._as_rows(x).data_ptr() == x.data_ptr()
    assert _host._as_rows(x).shape == (24, 16)
    wide = torch.randn(2, 3, 4, 32, dtype=torch.bfloat16, device=kernel_device)[..., :16]
    assert _host._as_rows(wide[0, 0]).data_ptr() == wide.data_ptr()  # rows of stride 32
    _check(lambda a, b: RMSNormFunction.apply(a, b, EPS, None, "llama", 0.0),
           x, w, dy, "llama", 0.0)


@pytest.mark.triton
def test_rms_norm_dispatches_to_torch_when_forced(kernel_device, monkeypatch):
    x, w, dy = _inputs((4, 32), torch.bfloat16, torch.float32, seed=11, device=kernel_device)

    def refuse(*args, **kwargs):
        raise AssertionError("the kernels ran")

    with ops.OPTIONS.override(interpret_cpu=True, eager_dispatch="torch"):
        monkeypatch.setattr(_host, "rms_norm_fwd", refuse)
        for mode, offset in VARIANTS:
            _check(lambda a, b, m=mode, o=offset: rms_norm(a, b, EPS, casting_mode=m, offset=o),
                   x, w, dy, mode, offset, _default_dtype(x, w, mode))


@pytest.mark.triton
def test_functions_refuse_bad_input_before_any_launch(kernel_device, monkeypatch):
    x, w, _ = _inputs((4, 32), torch.float32, torch.float32, seed=12, device=kernel_device)
    launched = []
    real_fwd, real_add = _host.rms_norm_fwd, _host.fused_add_rms_norm_fwd
    monkeypatch.setattr(_host, "rms_norm_fwd",
                        lambda *a, **k: launched.append(1) or real_fwd(*a, **k))
    monkeypatch.setattr(_host, "fused_add_rms_norm_fwd",
                        lambda *a, **k: launched.append(1) or real_add(*a, **k))
    with pytest.raises(TypeError, match="residual"):
        FusedAddRMSNormFunction.apply(x, x.to(torch.int32), w, EPS)
    with pytest.raises(TypeError, match="out_dtype"):
        FusedAddRMSNormFunction.apply(x, x, w, EPS, torch.int32)
    with pytest.raises(TypeError, match="out_dtype"):
        RMSNormFunction.apply(x, w, EPS, torch.int64)
    with pytest.raises(TypeError, match="eps"):
        RMSNormFunction.apply(x, w, "1e-5")
    with pytest.raises(ValueError, match="casting_mode"):
        RMSNormFunction.apply(x, w, EPS, None, "olmo")
    with ops.OPTIONS.override(interpret_cpu=True, eager_dispatch="kernels"):
        with pytest.raises(TypeError, match="out_dtype"):
            rms_norm(x, w, out_dtype=torch.int32)
        with pytest.raises(TypeError, match="residual"):
            fused_add_rms_norm(x, x.to(torch.int32), w)
    assert launched == []


def test_public_api_is_unchanged():
    assert tritonnorm.__all__ == [
        "HAS_TRITON", "FusedAddRMSNorm", "FusedAddRMSNormFunction", "RMSNorm",
        "RMSNormFunction", "RMSNormTorchFunction", "fused_add_rms_norm", "rms_norm",
        "rms_norm_backward_weight", "rms_norm_backward_x", "rms_norm_reference",
        "replace_rms_norms"]
