"""The model's architecture options (``rope``, ``qk_norm``, ``ffn="relu2"``,
``zero_init_proj``, ``logit_softcap``): each changes the function as its definition says
and nothing else, the parameter counts follow, decoding through the KV cache matches the
full forward, old configurations load unchanged, regional compilation and tensor (and
sequence) parallelism keep working, and a short run with all of them learns."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from lab2_testing.ddp_testkit import relative_error
from lab2_testing.dist import run_ranks
from lab2_trainer.config import ModelConfig
from lab2_trainer.models import shapes
from lab2_trainer.models.transformer import TransformerLM, rms_normalise, rotate

torch.set_num_threads(1)

SHAPE = dict(context_length=12, d_model=24, n_layers=2, n_heads=4, d_ff=48, vocab_size=40,
             norm="reference")
ALL = dict(rope=True, qk_norm=True, ffn="relu2", zero_init_proj=True, logit_softcap=5.0)
OPTIONS = [dict(rope=True), dict(qk_norm=True), dict(ffn="relu2"),
           dict(zero_init_proj=True), dict(logit_softcap=2.0), ALL]


def model(seed: int = 0, **fields) -> TransformerLM:
    return TransformerLM(ModelConfig(**{**SHAPE, **fields}), seed=seed).to(torch.float64)


def tokens(seed: int, t: int = 12, b: int = 2) -> torch.Tensor:
    return torch.randint(0, SHAPE["vocab_size"], (b, t), generator=torch.Generator()
                         .manual_seed(seed))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(
        ((a - b).norm() / b.norm()).detach())


def test_defaults_are_todays_model_and_old_configs_load_with_them():
    config = ModelConfig.from_dict({k: v for k, v in ModelConfig().to_dict().items()
                                    if k not in ("rope", "qk_norm", "zero_init_proj",
                                                 "logit_softcap")})
    assert (config.rope, config.qk_norm, config.zero_init_proj, config.logit_softcap) == (
        False, False, False, 0.0)
    assert config.ffn == "swiglu"
    # Same weights as a model built before the options (the seed's draws are unchanged).
    plain, zeroed = model(), model(zero_init_proj=True)
    for (name, p), q in zip(plain.named_parameters(), zeroed.parameters()):
        if name.endswith(("attn.proj.weight", "ffn.w2.weight")):
            assert not q.any()
        else:
            assert torch.equal(p, q), name


@pytest.mark.parametrize("fields", [dict(logit_softcap=-1.0), dict(ffn="relu3"),
                                    dict(rope=True, d_model=12, n_heads=4)])
def test_bad_options_are_refused_with_their_name(fields):
    with pytest.raises(ValueError, match="logit_softcap|ffn|rope"):
        ModelConfig(**{**SHAPE, **fields}).validate()


@pytest.mark.parametrize("fields", OPTIONS + [dict(rope=True, tie_embeddings=True)])
def test_parameter_counts_agree_with_the_model(fields):
    m = model(**fields)
    counts = shapes.parameter_counts(m.config)
    assert m.num_parameters() == counts["total"]
    assert m.num_parameters(non_embedding=True) == counts["total"] - counts["embeddings"]
    if m.config.rope:
        assert not any("pos_emb" in n for n, _ in m.named_parameters())
        assert "pos_emb.weight" not in m.state_dict()


def _reference_attention(attn, x: torch.Tensor, rope: bool, qk_norm: bool) -> torch.Tensor:
    """One attention layer written out in float64: rotation by complex multiplication of
    (x[i], x[i + h/2]) pairs, explicit causal softmax."""
    b, t, d = x.shape
    h = attn.n_heads
    hd = d // h
    q, k, v = (x @ attn.qkv.weight.T).split(d, dim=-1)
    q, k, v = (z.view(b, t, h, hd).transpose(1, 2) for z in (q, k, v))
    if qk_norm:
        q = q / q.pow(2).mean(-1, keepdim=True).add(attn.qk_norm_eps).sqrt()
        k = k / k.pow(2).mean(-1, keepdim=True).add(attn.qk_norm_eps).sqrt()
    if rope:
        half = hd // 2
        freq = torch.tensor([10000.0 ** (-i / half) for i in range(half)], dtype=torch.float64)
        turn = torch.polar(torch.ones(t, half, dtype=torch.float64),
                           torch.arange(t, dtype=torch.float64)[:, None] * freq)

        def spin(z):
            zc = torch.complex(z[..., :half], z[..., half:]) * turn
            return torch.cat([zc.real, zc.imag], dim=-1)
        q, k = spin(q), spin(k)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    y = scores.softmax(-1) @ v
    return y.transpose(1, 2).reshape(b, t, d) @ attn.proj.weight.T


@pytest.mark.parametrize("rope, qk_norm", [(True, False), (False, True), (True, True)])
def test_attention_matches_a_float64_reference(rope, qk_norm):
    m = model(seed=3, rope=rope, qk_norm=qk_norm)
    attn = m.blocks[0].attn
    x = torch.randn(2, 12, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    assert rel(attn(x), _reference_attention(attn, x, rope, qk_norm)) < 1e-12
    plain = model(seed=3, rope=False, qk_norm=False)
    assert rel(plain(tokens(1)), m(tokens(1))) > 1e-3  # a different function


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), start=st.integers(0, 11))
def test_the_rope_table_rotates_as_the_angles_made_on_the_fly(seed, start):
    m = TransformerLM(ModelConfig(**SHAPE, rope=True), seed=seed)  # built on meta, filled
    table = m.blocks[1].attn.rope_cos_sin
    assert table.dtype == torch.float64 and tuple(table.shape) == (12, 6)
    assert not any("rope" in name for name in m.state_dict())  # made from the shape
    x = torch.randn(2, 4, 12 - start, 6, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(seed))
    assert rel(rotate(x, start, table), rotate(x, start)) < 1e-15
    # A float32 rotation reads the float64 table cast; past its end the angles are made.
    assert rel(rotate(x.float(), start, table).double(), rotate(x, start)) < 1e-6
    assert rel(rotate(x, start + 3, table), rotate(x, start + 3)) < 1e-15


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), shift=st.integers(1, 50))
def test_rope_scores_depend_only_on_the_distance(seed, shift):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 1, 2, 5, 8, dtype=torch.float64, generator=gen)
    scores = rotate(q, 0) @ rotate(k, 0).transpose(-1, -2)
    shifted = rotate(q, shift) @ rotate(k, shift).transpose(-1, -2)
    assert rel(shifted, scores) < 1e-12
    assert rel(rotate(q, shift).norm(dim=-1), q.norm(dim=-1)) < 1e-12  # a rotation


def test_qk_norm_rows_have_unit_rms():
    x = torch.randn(3, 4, 7, 16, dtype=torch.float64) * 9
    rms = rms_normalise(x, 1e-12).pow(2).mean(-1).sqrt()
    assert rel(rms, torch.ones_like(rms)) < 1e-9
    for dtype in (torch.float32, torch.bfloat16):  # computed wide, returned in its dtype
        y = rms_normalise(x.to(dtype), 1e-6)
        assert y.dtype == dtype
        assert rel(y.double(), rms_normalise(x, 1e-6)) < {torch.float32: 1e-6,
                                                         torch.bfloat16: 1e-2}[dtype]


def test_relu2_feed_forward_is_w2_of_relu_squared():
    ffn = model(seed=2, ffn="relu2").blocks[1].ffn
    assert ffn.w3 is None
    x = torch.randn(5, 24, dtype=torch.float64)
    ref = (F.relu(x @ ffn.w1.weight.T) ** 2) @ ffn.w2.weight.T
    assert rel(ffn(x), ref) < 1e-13


def test_zero_init_proj_blocks_are_the_identity_at_init():
    m = model(zero_init_proj=True)
    x = torch.randn(2, 12, 24, dtype=torch.float64)
    for block in m.blocks:
        out, pending = block(x, torch.zeros_like(x))
        assert torch.equal(out, x) and not pending.any()


def test_softcap_bounds_logits_and_is_tanh_of_the_plain_ones():
    cap = 0.5
    plain, capped = model(seed=5), model(seed=5, logit_softcap=cap)
    idx = tokens(2)
    logits, loss = capped(idx, idx)
    assert logits.abs().max() < cap
    assert rel(logits, cap * torch.tanh(plain(idx) / cap)) < 1e-13
    ref = F.cross_entropy(logits.flatten(0, 1), idx.flatten())
    assert abs(float((loss - ref).detach())) < 1e-12
    cache = capped.new_kv_cache()
    assert capped.forward_cached(idx, cache).abs().max() < cap


@pytest.mark.parametrize("fields", [dict(rope=True), ALL])
def test_kv_cache_decoding_matches_the_full_forward(fields):
    m = model(seed=7, **fields).eval()
    idx = tokens(8)
    full = m(idx)
    cache = m.new_kv_cache()
    got = [m.forward_cached(idx[:, :5], cache)]  # a prefill, then 3 at once, then singles
    got.append(m.forward_cached(idx[:, 5:8], cache))
    got += [m.forward_cached(idx[:, i:i + 1], cache) for i in range(8, 12)]
    want = [full[:, 4], full[:, 7]] + [full[:, i] for i in range(8, 12)]
    for g, w in zip(got, want):
        assert rel(g, w) < 1e-12
    out = m.generate(idx[:, :4], 6, temperature=0)
    assert torch.equal(out, m.generate(idx[:, :4], 6, temperature=0, use_cache=False))


def test_regional_compilation_with_every_option():
    m = model(seed=1, **ALL)
    ref_logits, ref_loss = m(tokens(3), tokens(4))
    m.compile_regions(backend="eager")
    logits, loss = m(tokens(3), tokens(4))
    assert rel(logits, ref_logits) < 1e-12 and abs(float((loss - ref_loss).detach())) < 1e-12
    loss.backward()
    assert all(p.grad is not None for p in m.parameters())


def test_a_short_run_with_every_option_lowers_the_loss():
    torch.manual_seed(0)
    m = TransformerLM(ModelConfig(**{**SHAPE, **ALL}), seed=0)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    # A learnable stream: each token is the previous plus one.
    start = torch.randint(0, SHAPE["vocab_size"], (16, 1), generator=torch.Generator()
                          .manual_seed(0))
    seq = (start + torch.arange(13)) % SHAPE["vocab_size"]
    losses = []
    for _ in range(30):
        _, loss = m(seq[:, :-1], seq[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


# --------------------------------------------------------- tensor and sequence parallel
def _tp_rank(rank, world_size):
    from lab2_trainer.parallel.mesh import Mesh
    from lab2_trainer.parallel.parallelize import parallelize
    from lab2_trainer.training.step import train_step

    out = {}
    for sp in (False, True):
        parallel = parallelize(model(**ALL), sharding="none", ddp="none", device="cpu",
                               lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, bucket_mb=0.001,
                               mesh=Mesh.data_tensor(world_size), sequence_parallel=sp)
        losses = [float(train_step(parallel, [batch], precision="fp32", device="cpu",
                                   clip=0.0)[0]) for batch in _tp_batches()]
        out[sp] = (losses, parallel.full_model_state(rank))
    return out


def _tp_batches():
    return [(tokens(20 + i, b=4), tokens(40 + i, b=4)) for i in range(3)]


@pytest.mark.gloo
def test_tensor_and_sequence_parallel_steps_match_one_process():
    from lab2_trainer.parallel.parallelize import parallelize
    from lab2_trainer.training.step import train_step

    parallel = parallelize(model(**ALL), sharding="none", ddp="none", device="cpu", lr=1e-2,
                           betas=(0.9, 0.95), weight_decay=0.1, bucket_mb=0.001)
    ref = [float(train_step(parallel, [b], precision="fp32", device="cpu", clip=0.0)[0])
           for b in _tp_batches()]
    ref_state = parallel.model.state_dict()
    per_rank = run_ranks(_tp_rank, 2, timeout=240)
    for sp in (False, True):
        losses, state = per_rank[0][sp]
        assert all(abs(a - b) < 1e-9 * abs(b) for a, b in zip(losses, ref)), (sp, losses, ref)
        assert relative_error(ref_state, state) < 1e-10, sp
