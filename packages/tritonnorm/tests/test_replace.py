"""replace_rms_norms: swapping a model's RMSNorms for tritonnorm's, in place, on the CPU."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import tritonnorm
from lab2_testing.tn_numerics import TOL, dx_scale, rel_err, rms_norm_ref
from tritonnorm import RMSNorm, replace_rms_norms
from tritonnorm import nn as patching
from tritonnorm.nn import MachineEpsRMSNorm, to_tritonnorm

pytestmark = pytest.mark.skipif(not hasattr(nn, "RMSNorm"), reason="nn.RMSNorm: PyTorch 2.4")

H = 24


class LlamaStyleRMSNorm(nn.Module):
    """Hugging Face's LlamaRMSNorm with the compatibility declaration (float64 stays float64
    here; Hugging Face computes it in float32)."""

    __tritonnorm_compatible__ = True

    def __init__(self, hidden_size, eps=1e-6, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        # Hugging Face's order: normalise in (at least) float32, round back, then the weight.
        input_dtype = hidden_states.dtype
        compute = torch.promote_types(input_dtype, torch.float32)
        normed = rms_norm_ref(hidden_states, eps=self.variance_epsilon, dtype=compute)
        return self.weight * normed.to(input_dtype)


class Block(nn.Module):
    def __init__(self, dtype, norm):
        super().__init__()
        self.norm = norm
        self.proj = nn.Linear(H, H, dtype=dtype)

    def forward(self, x):
        return x + self.proj(self.norm(x))


class TinyModel(nn.Module):
    """Nested containers, a norm shared by two parents, eps=None, and a declared module."""

    def __init__(self, dtype=torch.float64):
        super().__init__()
        shared = nn.RMSNorm(H, eps=1e-6, dtype=dtype)
        self.blocks = nn.ModuleList([
            Block(dtype, nn.RMSNorm(H, dtype=dtype)),  # eps=None
            Block(dtype, LlamaStyleRMSNorm(H, eps=1e-5, dtype=dtype)),
            Block(dtype, shared),
        ])
        self.head = nn.Sequential(
            nn.Sequential(nn.Linear(H, H, dtype=dtype), nn.RMSNorm(H, eps=0.1, dtype=dtype)),
            nn.ModuleDict({"out_norm": shared}),
        )
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g, dtype=torch.float64))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head[1]["out_norm"](self.head[0](x))


N_NORMS = 4  # distinct norm modules in TinyModel (the shared one counts once)


def _norms(model):
    return [m for m in model.modules() if isinstance(m, (nn.RMSNorm, LlamaStyleRMSNorm, RMSNorm))]


def _run(model, x, dy):
    x = x.clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    y = model(x)
    y.backward(dy)
    return y.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_swap_keeps_outputs_gradients_parameters_and_state_dict(dtype):
    model = TinyModel(dtype)
    ref = copy.deepcopy(model)
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    assert replace_rms_norms(model) == N_NORMS

    norms = _norms(model)
    assert len(norms) == N_NORMS and all(isinstance(m, RMSNorm) for m in norms)
    assert isinstance(model.blocks[0].norm, MachineEpsRMSNorm) and model.blocks[0].norm.eps is None
    assert model.blocks[1].norm.eps == 1e-5 and model.head[0][1].eps == 0.1
    assert model.blocks[2].norm is model.head[1]["out_norm"]  # still one shared module
    # The same Parameter objects under the same names, and the same state dict.
    assert dict(model.named_parameters()).keys() == params.keys()
    assert all(p is params[n] for n, p in model.named_parameters())
    assert list(model.state_dict()) == keys
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in model.state_dict().items())

    g = torch.Generator().manual_seed(1)
    for _ in range(2):  # fresh inputs each time, never zeros; small rows so eps matters
        x = (torch.randn(3, 5, H, generator=g, dtype=torch.float64) * 0.05 + 0.01).to(dtype)
        dy = torch.randn(3, 5, H, generator=g, dtype=torch.float64).to(dtype)
        y_ref, dx_ref, grads_ref = _run(ref, x, dy)
        y, dx, grads = _run(model, x, dy)
        assert y.dtype == dtype and rel_err(y, y_ref) < TOL[dtype]
        assert rel_err(dx, dx_ref) < TOL[dtype]
        for name, grad in grads.items():
            assert rel_err(grad, grads_ref[name]) < TOL[dtype], name


def test_second_call_swaps_nothing():
    model = TinyModel()
    assert replace_rms_norms(model) == N_NORMS
    before = list(model.modules())
    assert replace_rms_norms(model) == 0
    assert list(model.modules()) == before


@pytest.mark.filterwarnings("ignore:Mismatch dtype")  # a float32 weight, x of another dtype
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_eps_none_means_what_torch_means(dtype):
    # Rows with mean square ~1e-5 to 4e-4: every candidate eps (float32's 1.2e-7, float16's
    # 1e-3, bfloat16's 8e-3, a fixed 1e-5) gives a different answer.
    torch_norm = nn.RMSNorm(H)
    with torch.no_grad():
        torch_norm.weight.copy_(1.0 + 0.5 * torch.randn(H))
    model = nn.Sequential(torch_norm)
    ref = copy.deepcopy(model)
    assert replace_rms_norms(model) == 1 and model[0].eps is None
    g = torch.Generator().manual_seed(2)
    scale = torch.logspace(-2.5, -1.7, 6, dtype=torch.float64).unsqueeze(-1)
    x = (torch.randn(6, H, generator=g, dtype=torch.float64) * scale).to(dtype)
    assert rel_err(model(x), ref(x)) < TOL[dtype]


def test_eps_none_table_follows_older_pytorch(monkeypatch):
    # PyTorch < 2.7 used the input dtype's own machine epsilon; the table asks torch which.
    def old_rms_norm(x, shape, weight=None, eps=None):
        eps = torch.finfo(x.dtype).eps if eps is None else eps
        return rms_norm_ref(x, eps=eps, dtype=torch.float32).to(x.dtype)

    monkeypatch.setattr(patching, "_NONE_EPS", {})
    monkeypatch.setattr(torch.nn.functional, "rms_norm", old_rms_norm)
    table = patching._none_eps_table()
    assert table[torch.bfloat16] == torch.finfo(torch.bfloat16).eps
    assert table[torch.float16] == torch.finfo(torch.float16).eps
    assert table[torch.float32] == torch.finfo(torch.float32).eps
    monkeypatch.undo()
    table = patching._none_eps_table()  # this PyTorch's again
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        x = torch.full((1, 4), 2.0**-6, dtype=dtype)
        expected = torch.nn.functional.rms_norm(x, (4,))
        assert torch.equal(MachineEpsRMSNorm(4, dtype=dtype)(x), expected), dtype
    assert table[torch.float64] == torch.finfo(torch.float64).eps


def test_eps_none_module_compiles_whole():
    model = nn.Sequential(nn.Linear(H, H), nn.RMSNorm(H))
    replace_rms_norms(model)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    x = torch.randn(2, H)
    assert rel_err(compiled(x), model(x)) < TOL[torch.float32]


def test_optimizer_built_before_the_swap_keeps_training():
    model = TinyModel()
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, H, generator=g, dtype=torch.float64)
    for step in range(3):
        if step == 1:  # one step before the swap, two after
            assert replace_rms_norms(model) == N_NORMS
        for m, o in ((model, opt), (ref, opt_ref)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for (n, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        assert rel_err(p.detach(), p_ref.detach()) < 1e-12, n


def test_training_mode_device_dtype_and_hooks_are_kept():
    model = nn.Sequential(nn.RMSNorm(H, eps=1e-5, dtype=torch.bfloat16), nn.RMSNorm(H))
    model[0].eval()
    calls = []
    model[0].register_forward_pre_hook(lambda m, args: calls.append("pre"))
    model[0].register_forward_hook(lambda m, args, out: calls.append("post"))
    model[0].register_full_backward_hook(lambda m, gin, gout: calls.append("backward"))
    removed = model[1].register_forward_hook(lambda m, args, out: calls.append("removed"))
    assert replace_rms_norms(model) == 2
    assert not model[0].training and model[1].training
    assert model[0].weight.dtype == torch.bfloat16 and model[0].weight.device.type == "cpu"
    removed.remove()  # a handle from before the swap still removes its hook
    x = torch.randn(2, H, dtype=torch.bfloat16, requires_grad=True)
    model(x).float().sum().backward()
    assert calls == ["pre", "post", "backward"]


class _Declared(nn.Module):
    __tritonnorm_compatible__ = True

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(H))
        self.eps = 1e-6


def _declared_with(change):
    m = _Declared()
    change(m)
    return m


def test_refusals_raise_before_changing_anything():
    model = nn.Sequential(
        nn.RMSNorm(H),
        _declared_with(lambda m: m.register_buffer("scale", torch.ones(1))),
        nn.RMSNorm((4, H)),
    )
    before = list(model)
    with pytest.raises(ValueError) as info:
        replace_rms_norms(model)
    msg = str(info.value)
    assert "1 (_Declared): it holds more than `weight` (scale)" in msg
    assert "2 (RMSNorm): normalized_shape=(4, 24)" in msg and "last dimension only" in msg
    assert "nothing was changed" in msg and "strict=False" in msg
    assert list(model) == before


def test_non_strict_skips_with_one_warning():
    model = nn.Sequential(nn.RMSNorm(H), nn.RMSNorm((4, H)))
    with pytest.warns(UserWarning, match="1 \\(RMSNorm\\): normalized_shape=\\(4, 24\\)"):
        assert replace_rms_norms(model, strict=False) == 1
    assert isinstance(model[0], RMSNorm) and type(model[1]) is nn.RMSNorm


@pytest.mark.parametrize("module, why", [
    (_declared_with(lambda m: delattr(m, "eps")), "neither an `eps` nor a `variance_epsilon`"),
    (_declared_with(lambda m: setattr(m, "variance_epsilon", 1e-5)), "differ"),
    (_declared_with(lambda m: setattr(m, "eps", torch.tensor(1e-6))), "Python number"),
    (_declared_with(lambda m: setattr(m, "eps", -1.0)), ">= 0"),
    (_declared_with(lambda m: m.register_buffer("scale", torch.ones(1))), "more than `weight`"),
    (_declared_with(lambda m: setattr(m, "weight", nn.Parameter(torch.ones(2, H)))), "1-D"),
    (_declared_with(lambda m: setattr(m, "forward", lambda x: x)), "replaced on the instance"),
])
def test_a_declared_module_must_follow_the_rule(module, why):
    with pytest.raises(ValueError, match=why):
        replace_rms_norms(nn.Sequential(module))


def test_which_classes_are_candidates():
    class OwnForward(nn.RMSNorm):  # not declared: its forward may compute anything
        def forward(self, x):
            return super().forward(x) * 2

    class KeepsForward(nn.RMSNorm):
        pass

    class OptedOut(nn.RMSNorm):
        __tritonnorm_compatible__ = False

    model = nn.Sequential(OwnForward(H), KeepsForward(H, eps=1e-6), OptedOut(H), RMSNorm(H))
    kept = model[3]
    assert replace_rms_norms(model) == 1
    assert type(model[0]) is OwnForward and type(model[2]) is OptedOut
    assert type(model[1]) is RMSNorm and model[1].eps == 1e-6
    assert model[3] is kept  # already tritonnorm's: not counted, not rebuilt


def test_root_norm_is_refused_and_to_tritonnorm_converts_one():
    norm = nn.RMSNorm(H, eps=1e-6)
    with pytest.raises(ValueError, match="to_tritonnorm"):
        replace_rms_norms(norm)
    new = to_tritonnorm(norm)
    assert type(new) is RMSNorm and new.weight is norm.weight and new.eps == 1e-6
    scale_free = to_tritonnorm(nn.RMSNorm(H, elementwise_affine=False))
    assert type(scale_free) is MachineEpsRMSNorm and scale_free.weight is None
    with pytest.raises(ValueError, match="not swapped"):
        to_tritonnorm(nn.Linear(H, H))
    with pytest.raises(TypeError):
        replace_rms_norms([norm])


def test_exported_at_top_level():
    assert tritonnorm.replace_rms_norms is replace_rms_norms


@given(
    hidden=st.integers(1, 300),
    dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16]),
    eps=st.sampled_from([None, 0.0, 1e-6, 1e-5, 1e-2]),
    seed=st.integers(0, 2**31 - 1),
)
def test_swapped_norm_matches_torch_property(hidden, dtype, eps, seed):
    g = torch.Generator().manual_seed(seed)
    torch_norm = nn.RMSNorm(hidden, eps=eps, dtype=dtype)
    with torch.no_grad():
        torch_norm.weight.copy_(1.0 + 0.5 * torch.randn(hidden, generator=g, dtype=torch.float64))
    model = nn.Sequential(torch_norm)
    ref = copy.deepcopy(model)
    assert replace_rms_norms(model) == 1 and model[0].weight is torch_norm.weight
    x = (torch.randn(3, hidden, generator=g, dtype=torch.float64) * 0.1 + 0.01).to(dtype)
    dy = torch.randn(3, hidden, generator=g, dtype=torch.float64).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y_ref, dx_ref, gw_ref = _run(ref, x, dy)
    y, dx, gw = _run(model, x, dy)
    assert y.dtype == dtype and rel_err(y, y_ref) < TOL[dtype]
    # dx is a difference of larger terms: measure its error against their size.
    eps_used = model[0]._eps_by_dtype[dtype] if eps is None else eps
    assert rel_err(dx, dx_ref, dx_scale(x, torch_norm.weight, dy, eps_used)) < TOL[dtype]
    assert rel_err(gw["0.weight"], gw_ref["0.weight"]) < TOL[dtype]


def test_scale_free_norm_is_swapped_and_matches_torch():
    # nn.RMSNorm(elementwise_affine=False): no weight, no parameter, no state-dict key.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(H, H), nn.RMSNorm(H, eps=1e-6, elementwise_affine=False))
    x = torch.randn(5, H)
    y_ref = model(x)
    keys = list(model.state_dict())
    assert replace_rms_norms(model) == 1
    assert type(model[1]) is RMSNorm and model[1].weight is None
    assert list(model.state_dict()) == keys
    assert rel_err(model(x), y_ref) < TOL[torch.float32]


class _HFLlamaRMSNorm(nn.Module):  # Hugging Face's formulas, not declared: found by the probe
    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(input_dtype)


class _HFOlmo2RMSNorm(_HFLlamaRMSNorm):
    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight * h).to(input_dtype)


class _HFGemmaRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class _BiasFreeLayerNorm(nn.Module):  # the structure of a norm, but it subtracts the mean
    def __init__(self, hidden, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, x.shape[-1:], self.weight, None, self.eps)


class _WrongEpsRMSNorm(_HFLlamaRMSNorm):  # its forward ignores its eps attribute
    def forward(self, hidden_states):
        h = hidden_states.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 0.1)).to(
            hidden_states.dtype)


@pytest.mark.parametrize("cls, mode, offset", [
    (_HFLlamaRMSNorm, "llama", 0.0), (_HFOlmo2RMSNorm, "none", 0.0),
    (_HFGemmaRMSNorm, "gemma", 1.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hugging_face_formulas_are_found_by_probing(cls, mode, offset, dtype):
    torch.manual_seed(0)
    norm = cls(H)
    with torch.no_grad():
        norm.weight.add_(0.3 * torch.randn(H))
    norm = norm.to(dtype)
    model = nn.Sequential(nn.Linear(H, H, dtype=dtype), norm)
    x = torch.randn(3, 5, H, dtype=dtype)
    y_ref = model(x)
    weight = norm.weight
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert replace_rms_norms(model) == 1
    new = model[1]
    assert type(new) is RMSNorm and new.weight is weight
    assert (new.casting_mode, new.offset, new.eps) == (mode, offset, 1e-6)
    y = model(x)
    assert y.dtype == y_ref.dtype and torch.equal(y, y_ref)  # bit for bit on the CPU


def test_structures_that_compute_something_else_are_left_alone():
    model = nn.Sequential(_BiasFreeLayerNorm(H), _WrongEpsRMSNorm(H))
    with pytest.warns(UserWarning, match="_WrongEpsRMSNorm") as record:
        assert replace_rms_norms(model) == 0
    assert not any("_BiasFreeLayerNorm" in str(w.message) for w in record)
    assert type(model[0]) is _BiasFreeLayerNorm and type(model[1]) is _WrongEpsRMSNorm


class _GatedRMSNorm(_HFLlamaRMSNorm):
    """The shape of Hugging Face's gated norms (Mamba 2, Bamba, GraniteMoeHybrid, NemotronH,
    Zamba2): Llama's formula while the gate is None, so a probe alone would accept it."""

    def forward(self, hidden_states, gate=None):
        if gate is not None:
            hidden_states = hidden_states * torch.nn.functional.silu(gate.float()).to(
                hidden_states.dtype)
        return super().forward(hidden_states)


class _GatedBlock(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.gate_proj = nn.Linear(H, H)
        self.norm = norm

    def forward(self, x):
        return self.norm(x, self.gate_proj(x))


GATED = ["MambaRMSNormGated", "BambaRMSNormGated", "GraniteMoeHybridRMSNormGated",
         "NemotronHRMSNormGated", "Zamba2RMSNormGated"]


@pytest.mark.parametrize("name", GATED)
def test_gated_norms_are_never_swapped(name):
    gated = type(name, (_GatedRMSNorm,), {})(H)
    model = nn.Sequential(nn.RMSNorm(H, eps=1e-6), _GatedBlock(gated), _HFLlamaRMSNorm(H))
    x = torch.randn(3, H)
    y_ref = model(x)
    with pytest.warns(UserWarning, match=f"{name}.*takes more than the hidden states"):
        assert replace_rms_norms(model) == 2
    assert model[1].norm is gated
    assert isinstance(model[0], RMSNorm) and isinstance(model[2], RMSNorm)
    assert rel_err(model(x), y_ref) < TOL[torch.float32]  # the model still runs


def test_declared_gated_norm_is_refused_before_anything_changes():
    declared = type("DeclaredGated", (_GatedRMSNorm,), {"__tritonnorm_compatible__": True})
    model = nn.Sequential(nn.RMSNorm(H), _GatedBlock(declared(H)))
    before = list(model.modules())
    with pytest.raises(ValueError, match="takes more than the hidden states"):
        replace_rms_norms(model)
    assert list(model.modules()) == before


class _T5LayerNorm(_HFLlamaRMSNorm):
    """T5's norm: an RMSNorm whose x_hat is rounded to the weight's dtype, not x's."""

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


def test_t5_norm_is_left_alone_with_a_warning():
    model = nn.Sequential(_T5LayerNorm(H), _BiasFreeLayerNorm(H))
    with pytest.warns(UserWarning, match="_T5LayerNorm.*RMSNorm in float32") as record:
        assert replace_rms_norms(model) == 0
    assert not any("_BiasFreeLayerNorm" in str(w.message) for w in record)
    assert type(model[0]) is _T5LayerNorm


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit is deprecated in new PyTorch
def test_torchscript_modules_are_left_alone_with_a_warning():
    scripted = torch.jit.script(nn.Sequential(nn.Linear(H, H), nn.RMSNorm(H)))
    with pytest.warns(UserWarning, match="TorchScript modules \\(the model itself\\)"):
        assert replace_rms_norms(scripted) == 0
    model = nn.Sequential(nn.RMSNorm(H), torch.jit.script(nn.Sequential(nn.RMSNorm(H))))
    with pytest.warns(UserWarning, match="TorchScript modules \\(1\\) cannot be changed"):
        assert replace_rms_norms(model) == 1
    assert isinstance(model[0], RMSNorm)


class _Picky(nn.Module):
    """A parent that refuses to hold tritonnorm's module."""

    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(H)

    def __setattr__(self, name, value):
        if isinstance(value, RMSNorm):
            raise RuntimeError("no tritonnorm here")
        super().__setattr__(name, value)


def test_a_failed_swap_is_undone_whole():
    model = nn.Sequential(nn.RMSNorm(H), _Picky())
    first = model[0]
    with pytest.raises(RuntimeError, match="no tritonnorm here"):
        replace_rms_norms(model)
    assert model[0] is first and type(model[1].norm) is nn.RMSNorm
