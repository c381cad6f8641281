"""ModelConfig validation and presets; TransformerLM shapes, causality, init and sampling."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from lab2_testing.tn_numerics import rms_norm_ref
from lab2_trainer.config import PRESETS, ModelConfig, model_config
from lab2_trainer.models.transformer import ReferenceRMSNorm, TransformerLM, make_norm

torch.set_num_threads(1)


def small_config(**kw) -> ModelConfig:
    fields = dict(context_length=16, d_model=32, n_layers=2, n_heads=4, d_ff=48)
    fields.update(kw)
    return ModelConfig(**fields).validate()


# ---------------------------------------------------------------- configuration


def test_presets_match_the_handout():
    expected = {"small": (768, 3072, 12, 12), "medium": (1024, 4096, 24, 16),
                "large": (1280, 5120, 36, 20), "xl": (1600, 6400, 48, 25),
                "2.7B": (2560, 10240, 32, 32)}
    for name, (d_model, d_ff, n_layers, n_heads) in expected.items():
        c = model_config(name)
        assert (c.d_model, c.d_ff, c.n_layers, c.n_heads) == (d_model, d_ff, n_layers, n_heads)
    assert "tiny" in PRESETS


@pytest.mark.parametrize(("name", "billions", "shape"), [
    ("6.7B", 6.7, (4096, 32, 32)),
    ("13B", 13.0, (5120, 40, 40)),
])
def test_gpt3_presets_have_the_tables_shape_and_their_names_parameters(name, billions, shape):
    from lab2_trainer.models.transformer import shape_model

    c = model_config(name)  # the config only; the model below has meta tensors, no memory
    assert (c.d_model, c.n_layers, c.n_heads) == shape
    assert c.d_ff % 256 == 0 and c.ffn == "swiglu"
    model = shape_model(c)
    blocks = model.num_parameters(non_embedding=True) - c.d_model * c.vocab_size  # no LM head
    # GPT-3's count: 12 d_model^2 per block, and its 50,257-token tied embedding table.
    total = blocks + (50257 + 2048) * c.d_model
    assert abs(total / (billions * 1e9) - 1) < 0.03, total
    assert abs(blocks / (12 * c.n_layers * c.d_model ** 2) - 1) < 0.02


def test_overrides_replace_fields_and_none_is_ignored():
    c = model_config("small", n_layers=2, d_ff=None, norm="layernorm")
    assert c.n_layers == 2 and c.d_ff == 3072 and c.norm == "layernorm"


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (dict(n_heads=5), "does not divide d_model"),
        (dict(d_model=0), "d_model must be a positive integer"),
        (dict(norm="batchnorm"), "norm must be one of"),
        (dict(ffn="relu"), "ffn must be one of"),
        (dict(eps=-1e-6), "eps must be"),
        (dict(n_layers=2.5), "n_layers must be a positive integer"),
        (dict(dropout=1.0), "dropout must be in \\[0, 1\\)"),
        (dict(dropout=-0.1), "dropout must be"),
    ],
)
def test_invalid_config_raises_one_clear_line(overrides, fragment):
    with pytest.raises(ValueError, match=fragment) as info:
        model_config("tiny", **overrides)
    assert "\n" not in str(info.value)



@pytest.mark.parametrize("eps", [0, 0.0, -0.0, 1e-5, 1, 1e300, -1e-9, -1, float("inf"),
                                 float("-inf"), float("nan")])
def test_eps_range_is_the_norms(eps):
    """The config accepts exactly the eps that the norms' own check (the one their kernels
    and reference run) accepts, and says so in the same words."""
    from tritonnorm.limits import check_eps

    try:
        check_eps(eps)
        norms_error = None
    except ValueError as err:
        norms_error = str(err)
    if norms_error is None:
        assert model_config("tiny", eps=eps).eps == eps
    else:
        with pytest.raises(ValueError) as info:
            model_config("tiny", eps=eps)
        range_words = norms_error.split(", got")[0].removeprefix("eps ")
        assert range_words in str(info.value)

def test_unknown_preset_and_field():
    with pytest.raises(ValueError, match="unknown preset"):
        model_config("huge")
    with pytest.raises(ValueError, match="unknown model config field"):
        model_config("tiny", d_modle=64)


def test_config_round_trips_through_dict():
    c = model_config("medium", tie_embeddings=True)
    assert ModelConfig.from_dict(c.to_dict()) == c


# ---------------------------------------------------------------- model


@pytest.mark.parametrize("norm", ["tritonnorm", "reference", "torch", "layernorm"])
@pytest.mark.parametrize("ffn", ["swiglu", "gelu"])
def test_shapes_and_loss(norm, ffn):
    torch.manual_seed(0)
    model = TransformerLM(small_config(norm=norm, ffn=ffn), seed=1)
    idx = torch.randint(0, 256, (3, 11))
    targets = torch.randint(0, 256, (3, 11))
    logits = model(idx)
    assert logits.shape == (3, 11, 256)
    logits2, loss = model(idx, targets)
    torch.testing.assert_close(logits2, logits)
    expected = F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))
    torch.testing.assert_close(loss, expected)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@given(t=st.integers(2, 16), cut=st.integers(1, 15), seed=st.integers(0, 2**16))
def test_future_tokens_do_not_change_past_logits(t, cut, seed):
    cut = min(cut, t - 1)
    model = TransformerLM(small_config(), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 256, (2, t), generator=gen)
    changed = idx.clone()
    changed[:, cut:] = torch.randint(0, 256, (2, t - cut), generator=gen)
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :cut], b[:, :cut], rtol=1e-5, atol=1e-5)


def test_init_is_deterministic_per_seed_and_independent_of_global_rng():
    torch.manual_seed(123)
    a = TransformerLM(small_config(), seed=7)
    torch.manual_seed(456)
    b = TransformerLM(small_config(), seed=7)
    c = TransformerLM(small_config(), seed=8)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.dim() == 2:
            assert not torch.equal(pa, pc), name


def test_dropout_acts_while_training_only_and_rate_zero_changes_nothing():
    idx = torch.randint(0, 256, (2, 16))
    plain = TransformerLM(model_config("tiny"), seed=0)
    dropped = TransformerLM(model_config("tiny", dropout=0.2), seed=0)
    dropped.load_state_dict(plain.state_dict())
    plain.train()
    dropped.train()
    torch.manual_seed(0)
    assert not torch.allclose(plain(idx), dropped(idx))
    plain.eval()
    dropped.eval()
    torch.testing.assert_close(plain(idx), dropped(idx), rtol=0, atol=0)
    plain.train()
    torch.testing.assert_close(plain(idx), plain(idx), rtol=0, atol=0)  # rate 0: no mask


def test_residual_projections_have_smaller_init():
    model = TransformerLM(model_config("tiny", n_layers=8), seed=0)
    std_in = model.blocks[0].attn.qkv.weight.std().item()
    std_out = model.blocks[0].attn.proj.weight.std().item()
    assert std_out < std_in / 3


@pytest.mark.parametrize("rope", [True, False])
def test_tied_embeddings_share_one_tensor_and_count_once(rope):
    untied = TransformerLM(small_config(rope=rope), seed=0)
    tied = TransformerLM(small_config(tie_embeddings=True, rope=rope), seed=0)
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert untied.num_parameters() - tied.num_parameters() == 256 * 32
    manual = sum(p.numel() for p in {id(p): p for p in untied.parameters()}.values())
    assert untied.num_parameters() == manual
    non_emb = untied.num_parameters(non_embedding=True)
    assert non_emb == manual - 256 * 32 - (0 if rope else 16 * 32)  # no position table


def test_sequence_longer_than_context_is_rejected():
    model = TransformerLM(small_config(), seed=0)
    with pytest.raises(ValueError, match="exceeds context_length"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_generate_appends_tokens_reproducibly():
    model = TransformerLM(small_config(), seed=0)
    prompt = torch.tensor([[1, 2, 3]])
    out1 = model.generate(prompt, 20, temperature=0.9, top_k=5,
                          generator=torch.Generator().manual_seed(0))
    out2 = model.generate(prompt, 20, temperature=0.9, top_k=5,
                          generator=torch.Generator().manual_seed(0))
    assert out1.shape == (1, 23) and torch.equal(out1, out2)
    assert torch.equal(out1[:, :3], prompt)
    greedy = model.generate(prompt, 5, temperature=0)
    with torch.no_grad():
        first = model(prompt)[:, -1].argmax(-1)
    assert greedy[0, 3] == first[0]
    assert model.training  # generate restores the mode


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_norm_kinds_agree_and_share_state_dicts(dtype):
    torch.manual_seed(0)
    x = torch.randn(4, 5, 24, dtype=dtype) * 3 + 0.5
    ref = rms_norm_ref(x, eps=1e-5)  # float64
    norms = {kind: make_norm(kind, 24, 1e-5).to(dtype) for kind in ("tritonnorm", "reference",
                                                                     "torch")}
    weight = torch.rand(24, dtype=dtype) + 0.5
    for norm in norms.values():
        norm.load_state_dict({"weight": weight})
        y = norm(x)
        rel = (y - ref * weight).norm() / (ref * weight).norm()
        assert rel < (1e-6 if dtype == torch.float32 else 1e-12)
    assert isinstance(norms["reference"], ReferenceRMSNorm)
    assert isinstance(make_norm("layernorm", 24), torch.nn.LayerNorm)


def test_model_state_dict_moves_between_rms_norm_kinds():
    a = TransformerLM(small_config(norm="tritonnorm"), seed=3)
    b = TransformerLM(small_config(norm="reference"), seed=99)
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(a(idx), b(idx), rtol=1e-5, atol=1e-5)
