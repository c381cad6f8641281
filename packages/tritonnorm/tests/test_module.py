"""The RMSNorm module: parameters, state-dict interchange with torch.nn.RMSNorm, compile."""

from __future__ import annotations

import pytest
import torch

from lab2_testing.tn_numerics import TOL, rel_err
from tritonnorm import RMSNorm, rms_norm_reference

HAS_TORCH_RMSNORM = hasattr(torch.nn, "RMSNorm")


def test_weight_starts_at_ones_and_is_the_only_parameter():
    m = RMSNorm(12, eps=1e-6, dtype=torch.bfloat16)
    assert [n for n, _ in m.named_parameters()] == ["weight"]
    assert m.weight.dtype == torch.bfloat16 and torch.equal(m.weight, torch.ones(12).bfloat16())
    assert "12" in repr(m) and "1e-06" in repr(m)


@pytest.mark.skipif(not HAS_TORCH_RMSNORM, reason="torch.nn.RMSNorm needs PyTorch 2.4")
def test_state_dict_interchangeable_with_torch_rmsnorm():
    ours = RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(16))
    theirs = torch.nn.RMSNorm(16, eps=1e-5)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(3, 5, 16)
    assert rel_err(ours(x), theirs(x)) < TOL[torch.float32]
    back = RMSNorm(16)
    back.load_state_dict(theirs.state_dict())
    assert torch.equal(back.weight, ours.weight)


def test_module_matches_reference_and_trains():
    m = RMSNorm(10)
    x = torch.randn(4, 10, requires_grad=True)
    y = m(x)
    assert rel_err(y, rms_norm_reference(x.detach().double(), m.weight.detach().double())) < 1e-6
    y.square().sum().backward()
    assert m.weight.grad is not None and x.grad is not None


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_hidden_size(bad):
    with pytest.raises(ValueError, match="hidden_size"):
        RMSNorm(bad)


def test_integer_dtype_rejected():
    with pytest.raises(TypeError):
        RMSNorm(8, dtype=torch.int32)


def test_compile_fullgraph_cpu():
    # On the CPU the module runs plain PyTorch; fullgraph=True must still trace it whole
    # (the "eager" backend checks the tracing without paying for code generation).
    model = RMSNorm(8)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    x = torch.randn(2, 3, 8)
    assert rel_err(compiled(x), model(x)) < 1e-6


def test_fused_add_module_with_and_without_a_residual_and_out_dtype():
    from tritonnorm import FusedAddRMSNorm

    m = FusedAddRMSNorm(10)
    x, r = torch.randn(4, 10), torch.randn(4, 10)
    y, s = m(x, r)
    assert torch.equal(s, x + r) and torch.equal(y, RMSNorm(10)(x + r))
    assert torch.equal(m(x), RMSNorm(10)(x))  # no residual: RMSNorm's forward, y alone
    half = m(x, out_dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half, RMSNorm(10)(x).bfloat16())
    y16, s32 = m(x, r.bfloat16(), out_dtype=torch.bfloat16)
    assert y16.dtype == torch.bfloat16 and s32.dtype == torch.float32
