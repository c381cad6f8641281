"""The Hugging Face drop-in: ``replace_rms_norms`` on tiny ``transformers`` models built
from their config classes (nothing downloaded), on the CPU.

Run by ``nox -s tests-hf`` (marker ``hf``), which installs ``transformers`` and sets
``TRITON_INTERPRET=1``: the swapped models then run tritonnorm's Triton kernels on the CPU
(``OPTIONS.interpret_cpu``). For each family: every RMSNorm is swapped; logits, loss and
every gradient match the unswapped model in float32 to 1e-5 relative; state-dict keys and
Parameter objects are unchanged; ``torch.compile(fullgraph=True)`` works on the swapped
model; a checkpoint saved from either loads into the other.
"""

from __future__ import annotations

import copy
import io
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tritonnorm  # noqa: E402
from tritonnorm.ops import OPTIONS  # noqa: E402

pytestmark = pytest.mark.hf

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TOL = 1e-5

#: family -> (config class name, expected (casting_mode, offset) of its norms).
FAMILIES = {
    "llama": ("LlamaConfig", ("llama", 0.0)),
    "qwen2": ("Qwen2Config", ("llama", 0.0)),
    "mistral": ("MistralConfig", ("llama", 0.0)),
    "qwen3": ("Qwen3Config", ("llama", 0.0)),
    "gemma": ("GemmaConfig", ("gemma", 1.0)),
    "gemma2": ("Gemma2Config", ("gemma", 1.0)),
    "olmo2": ("Olmo2Config", ("none", 0.0)),
}


def _tiny(family: str, seed: int = 0):
    config_cls = getattr(transformers, FAMILIES[family][0])
    config = config_cls(vocab_size=64, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, max_position_embeddings=64, use_cache=False,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():  # away from the initial values (Gemma's zero weights, say)
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def _hf_norms(model):
    return [m for m in model.modules() if "rmsnorm" in type(m).__name__.lower()
            and not isinstance(m, tritonnorm.RMSNorm)]


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.detach().clone()
             for n, p in model.named_parameters()}
    return out.logits.detach(), out.loss.detach(), grads


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _assert_same_step(got, want):
    logits, loss, grads = got
    logits_ref, loss_ref, grads_ref = want
    assert _rel(logits, logits_ref) < TOL
    assert _rel(loss, loss_ref) < TOL
    assert grads.keys() == grads_ref.keys()
    for name, g in grads.items():
        assert _rel(g, grads_ref[name]) < TOL, name


def _kernels():
    """Run the swapped norms on the Triton kernels (the interpreter's, on the CPU)."""
    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 (set by nox -s tests-hf)")
    return OPTIONS.override(interpret_cpu=True, eager_dispatch="kernels")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_swap_matches_the_unswapped_model(family):
    model = _tiny(family)
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    reference = copy.deepcopy(model)
    n_norms = len(_hf_norms(model))
    keys = list(model.state_dict())
    params = [(n, id(p)) for n, p in model.named_parameters()]
    assert n_norms > 0
    assert tritonnorm.replace_rms_norms(model) == n_norms
    assert _hf_norms(model) == []
    swapped = [m for m in model.modules() if isinstance(m, tritonnorm.RMSNorm)]
    assert {(m.casting_mode, m.offset) for m in swapped} == {FAMILIES[family][1]}
    assert list(model.state_dict()) == keys
    assert [(n, id(p)) for n, p in model.named_parameters()] == params
    want = _step(reference, ids)
    _assert_same_step(_step(model, ids), want)  # the plain-PyTorch path
    with _kernels():
        _assert_same_step(_step(model, ids), want)  # the Triton kernels


@pytest.mark.parametrize("family", list(FAMILIES))
def test_swapped_model_compiles_whole(family):
    # fullgraph=True: no graph break anywhere. aot_eager traces forward and backward as
    # Inductor would, without the minutes of C++ compilation Inductor takes on a CPU. The
    # norms run tritonnorm's plain-PyTorch path: the compiled kernels (torch.library
    # triton_ops) need real CUDA tensors, as the interpreter's kernels cannot be traced;
    # test_compile.py checks them on a GPU.
    model = _tiny(family)
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    want = _step(copy.deepcopy(model), ids)
    tritonnorm.replace_rms_norms(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    _assert_same_step(_step(compiled, ids), want)


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_checkpoints_interchange(family):
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    swapped = _tiny(family, seed=4)
    tritonnorm.replace_rms_norms(swapped)
    plain = _tiny(family, seed=5)  # other weights

    def roundtrip(src, dst):
        buf = io.BytesIO()
        torch.save(src.state_dict(), buf)
        buf.seek(0)
        dst.load_state_dict(torch.load(buf, weights_only=True), strict=True)

    roundtrip(swapped, plain)
    _assert_same_step(_step(plain, ids), _step(swapped, ids))
    other = _tiny(family, seed=6)
    tritonnorm.replace_rms_norms(other)
    roundtrip(_tiny(family, seed=7), other)
    _assert_same_step(_step(other, ids), _step(_tiny(family, seed=7), ids))


def test_unknown_formula_is_left_alone_with_a_warning():
    class ScaledRMSNorm(torch.nn.Module):  # an RMSNorm times 2: no formula tritonnorm has
        def __init__(self, hidden):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(hidden))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            r = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return 2 * self.weight * (x.float() * r).to(x.dtype)

    model = torch.nn.Sequential(ScaledRMSNorm(16), torch.nn.Linear(16, 16))
    with pytest.warns(UserWarning, match="ScaledRMSNorm"):
        assert tritonnorm.replace_rms_norms(model) == 0
    assert type(model[0]) is ScaledRMSNorm



#: (module of transformers.models, class): norms that must be left alone, with a warning.
#: The gated norms take forward(hidden_states, gate=None); T5's rounds x_hat to its weight's
#: dtype, which no casting mode of tritonnorm does.
LEFT_ALONE = [("mamba2", "MambaRMSNormGated"), ("bamba", "BambaRMSNormGated"),
              ("granitemoehybrid", "GraniteMoeHybridRMSNormGated"),
              ("nemotron_h", "NemotronHRMSNormGated"), ("zamba2", "Zamba2RMSNormGated"),
              ("t5", "T5LayerNorm")]


@pytest.mark.parametrize("family, name", LEFT_ALONE)
def test_gated_and_t5_norms_are_left_alone_with_a_warning(family, name):
    import importlib
    import inspect

    try:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except ImportError:
        pytest.skip(f"no {family} in transformers {transformers.__version__}")
    cls = getattr(module, name, None)
    if cls is None:
        pytest.skip(f"no {name} in transformers {transformers.__version__}")
    hidden = 16
    group = {"group_size": hidden} if "group_size" in inspect.signature(cls).parameters else {}
    norm = cls(hidden, **group)
    model = torch.nn.Sequential(norm, torch.nn.Linear(hidden, hidden))
    with pytest.warns(UserWarning, match=name):
        assert tritonnorm.replace_rms_norms(model) == 0
    assert model[0] is norm
