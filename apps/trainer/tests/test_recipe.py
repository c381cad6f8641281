"""The training recipe: defaults from the model's shape, the initialisation they assume,
and the compressors' figures the validation loss is printed beside."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lab2_trainer.config import ModelConfig, TrainSettings, model_config
from lab2_trainer.data.corpus import Corpus, compression_baselines
from lab2_trainer.models.transformer import TransformerLM
from lab2_trainer.parallel.parallelize import param_groups
from lab2_trainer.recipe import defaults as recipe
from lab2_trainer.reporting.report import compression_text

torch.set_num_threads(1)


def test_the_learning_rate_follows_the_gpt3_table_within_a_third():
    # GPT-3's table 2.1: (d_model, lr) from 125M to 13B.
    table = [(768, 6e-4), (1024, 3e-4), (1536, 2.5e-4), (2048, 2e-4), (2560, 1.6e-4),
             (4096, 1.2e-4), (5140, 1e-4)]
    for width, lr in table:
        assert abs(recipe.default_lr(width) / lr - 1) < 0.35, width


@given(st.integers(1, 10**7))
def test_warmup_is_five_percent_within_its_bounds_and_never_longer_than_the_run(steps):
    warmup = recipe.default_warmup(steps)
    assert warmup <= steps
    assert warmup == min(steps, max(20, min(500, round(0.05 * steps))))


def test_unset_settings_are_filled_from_the_recipe_and_given_ones_kept():
    s = TrainSettings(model=model_config("small"), steps=4000).validate(1)
    assert s.lr == pytest.approx(0.4 / 768)
    assert s.min_lr == pytest.approx(s.lr / 10)
    assert s.warmup == 200
    given = TrainSettings(model=model_config("small"), steps=4000, lr=1e-3, warmup=7)
    given.validate(1)
    assert (given.lr, given.min_lr, given.warmup) == (1e-3, pytest.approx(1e-4), 7)


def test_a_min_lr_above_the_rules_lr_is_named():
    s = TrainSettings(model=model_config("small"), min_lr=1e-2)
    with pytest.raises(ValueError, match="--min-lr must be in"):
        s.validate(1)


def test_a_saved_config_without_embed_scale_keeps_the_multiplier_it_was_trained_with():
    saved = model_config("tiny").to_dict()
    del saved["embed_scale"]
    assert ModelConfig.from_dict(saved).embed_scale == 1.0
    assert model_config("tiny").embed_scale == recipe.EMBED_SCALE
    with pytest.raises(ValueError, match="embed_scale"):
        model_config("tiny", embed_scale=0.0)


@pytest.mark.parametrize("rope", [False, True])
def test_the_stream_starts_at_unit_rms_and_the_logits_near_uniform(rope):
    config = model_config("tiny", d_model=256, n_heads=4, d_ff=512, rope=rope)
    model = TransformerLM(config, seed=3)
    idx = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0))
    x, _ = model.embed(idx)
    # Two tables of std 0.02 times 35.36 sum to unit RMS; under rope there is one table.
    rms = 1.0 if not rope else 2**-0.5
    assert x.pow(2).mean().sqrt().item() == pytest.approx(rms, rel=0.1)
    logits = model(idx)
    assert logits.std().item() == pytest.approx(recipe.LOGIT_STD, rel=0.2)
    residual = recipe.init_stds(256, config.n_layers)["residual"]
    assert model.blocks[0].attn.proj.weight.std().item() == pytest.approx(residual, rel=0.1)


def test_a_tied_head_takes_the_embedding_std():
    model = TransformerLM(model_config("tiny", tie_embeddings=True), seed=0)
    assert model.lm_head.weight is model.tok_emb.weight
    assert model.tok_emb.weight.std().item() == pytest.approx(recipe.EMBEDDING_STD, rel=0.1)


@pytest.mark.parametrize("rope", [False, True])
def test_embedding_tables_and_vectors_do_not_decay(rope):
    model = TransformerLM(model_config("tiny", rope=rope), seed=0)
    decay, no_decay = param_groups(model, 0.1)
    tables = {id(model.tok_emb.weight)} | ({id(model.pos_emb.weight)} if not rope else set())
    assert not tables & {id(p) for p in decay["params"]}
    assert tables <= {id(p) for p in no_decay["params"]}
    assert all(p.dim() == 2 for p in decay["params"])
    n = sum(p.numel() for g in (decay, no_decay) for p in g["params"])
    assert n == model.num_parameters()


def test_compressors_are_computed_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB2_CACHE_DIR", str(tmp_path))
    import numpy as np

    text = (b"def f(x):\n    return x + 1\n" * 400) + bytes(range(256)) * 4
    val = np.frombuffer(text, dtype=np.uint8)
    corpus = Corpus(val, val, 256, "test", is_bytes=True)
    first = compression_baselines(corpus)
    assert 0 < first["xz"] < first["gzip"] < 8 * math.log(2)
    assert list(tmp_path.glob("baselines/*.json"))
    import gzip as gzip_module

    monkeypatch.setattr(gzip_module, "compress", lambda *a, **k: pytest.fail("recomputed"))
    assert compression_baselines(corpus) == first


def test_the_summary_names_the_best_compressor():
    text = compression_text(0.9, {"gzip": 1.2, "xz": 1.0})
    assert "10.0% below xz's" in text and "gzip 1.2000" in text


def _new_run(tmp_path, argv):
    from lab2_trainer.cli.main import build_parser, given_settings, resolve_settings

    args = build_parser().parse_args([*argv, "--nproc", "1", "--out", str(tmp_path / "run")])
    return resolve_settings(given_settings(args), "cpu")[0]


def test_tiny_takes_its_own_run_defaults_unless_given(tmp_path):
    tiny = _new_run(tmp_path, [])
    assert (tiny.lr, tiny.batch_size, tiny.model.context_length) == (6e-3, 64, 64)
    assert tiny.min_lr == pytest.approx(6e-4)
    given = _new_run(tmp_path, ["--lr", "1e-3", "--batch-size", "8"])
    assert (given.lr, given.batch_size) == (1e-3, 8)


def test_a_preset_reshaped_or_without_its_own_defaults_takes_the_rules(tmp_path):
    wide = _new_run(tmp_path, ["--d-model", "256", "--n-heads", "4"])
    assert (wide.lr, wide.batch_size) == (recipe.default_lr(256), 32)
    small = _new_run(tmp_path, ["--preset", "small", "--n-layers", "1"])
    assert (small.lr, small.batch_size) == (recipe.default_lr(768), 32)
