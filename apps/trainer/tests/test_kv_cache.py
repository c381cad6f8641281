"""Generation with a KV cache: the same tokens as recomputing the window, and the cache's
shapes and bounds. The uncached forward of the same model is the oracle throughout."""

from __future__ import annotations

import pytest
import torch

from lab2_trainer.config import ModelConfig
from lab2_trainer.models.kv_cache import KVCache
from lab2_trainer.models.transformer import TransformerLM

torch.set_num_threads(1)
CONTEXT = 24


def model_for_test(seed: int = 0) -> TransformerLM:
    config = ModelConfig(context_length=CONTEXT, d_model=32, n_layers=3, n_heads=4, d_ff=48,
                         norm="torch").validate()
    model = TransformerLM(config, seed=seed).eval()
    with torch.no_grad():
        # Larger weights than the init's spread the logits apart, so an argmax is decided by
        # the model and not by the last bit of a sum that two attention paths order
        # differently.
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8)
    return model


def prompt(batch: int = 2, length: int = 5, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_tokens_equal_with_and_without_the_cache(seed):
    model = model_for_test(seed)
    ids = prompt(seed=seed)
    new = CONTEXT - ids.shape[1]  # up to a full window
    cached = model.generate(ids, new, temperature=0)
    recomputed = model.generate(ids, new, temperature=0, use_cache=False)
    assert torch.equal(cached, recomputed)
    assert len(set(cached[0, ids.shape[1]:].tolist())) > 1  # not one token repeated


def test_sampled_tokens_equal_with_and_without_the_cache():
    model = model_for_test()
    ids = prompt()
    kw = dict(temperature=0.9, top_k=20)
    cached = model.generate(ids, 15, generator=torch.Generator().manual_seed(3), **kw)
    recomputed = model.generate(ids, 15, generator=torch.Generator().manual_seed(3),
                                use_cache=False, **kw)
    assert torch.equal(cached, recomputed)


def test_beyond_the_window_the_cache_is_refilled_from_half_a_window():
    model = model_for_test()
    ids = prompt(length=CONTEXT + 3)  # a prompt longer than the window, too
    steps = 2 * CONTEXT + 5
    got = model.generate(ids, steps, temperature=0)
    # The documented rule spelled out with uncached forwards: the window starts at the
    # prompt's last CONTEXT tokens and, whenever it would exceed CONTEXT, restarts at the
    # last CONTEXT // 2 tokens.
    seq = ids.clone()
    start = seq.shape[1] - CONTEXT
    with torch.no_grad():
        for _ in range(steps):
            if seq.shape[1] - start > CONTEXT:
                start = seq.shape[1] - CONTEXT // 2
            nxt = model(seq[:, start:])[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(got, seq)


def test_cache_shapes_lengths_and_bounds():
    model = model_for_test()
    cfg = model.config
    cache = model.new_kv_cache()
    assert cache.capacity == CONTEXT and cache.length == 0 and len(cache.layers) == cfg.n_layers
    ids = prompt(batch=3, length=7)
    logits = model.forward_cached(ids, cache)
    assert logits.shape == (3, cfg.vocab_size) and cache.length == 7
    for layer in cache.layers:
        assert layer.keys.shape == layer.values.shape == (3, cfg.n_heads, CONTEXT, cfg.head_dim)
        assert layer.keys.dtype == torch.float32
    nxt = torch.tensor([[4], [5], [6]])
    model.forward_cached(nxt, cache)
    assert cache.length == 8 and cache.free == CONTEXT - 8
    # Several tokens after held ones (the explicitly masked path) agree with a full forward.
    more = prompt(batch=3, length=4, seed=9)
    got = model.forward_cached(more, cache)
    with torch.no_grad():
        full = model(torch.cat([ids, nxt, more], dim=1))[:, -1]
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)
    # Bounds and layouts.
    with pytest.raises(ValueError, match="exceed the KV cache"):
        model.forward_cached(prompt(batch=3, length=CONTEXT - 11), cache)
    with pytest.raises(ValueError, match=r"\(batch, heads, _, head_dim\)"):
        model.forward_cached(prompt(batch=2, length=1), cache)
    with pytest.raises(ValueError, match="layers"):
        model.forward_cached(ids, KVCache(cfg.n_layers + 1, CONTEXT))
    with pytest.raises(ValueError, match="n_layers >= 1"):
        KVCache(0, CONTEXT)
    cache.reset()
    assert cache.length == 0 and cache.free == CONTEXT
    # The attention modules are left without a cache: the model trains as before.
    assert all(attn.kv is None for attn in model.attention_layers())
