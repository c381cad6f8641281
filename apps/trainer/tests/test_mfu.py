"""MFU: the FLOPs formula, the peak table, and MFU in the training records and summary."""

from __future__ import annotations

import json

import pytest
import torch

from lab2_trainer.config import ModelConfig, TrainSettings
from lab2_trainer.models.shapes import training_flops_per_token
from lab2_trainer.models.transformer import TransformerLM
from lab2_trainer.reporting.report import Peak, device_peak, matmul_parameters, mfu, peak_for_name
from lab2_trainer.runtime.launch import DistContext
from lab2_trainer.training import loop as train_module
from lab2_trainer.training.loop import Trainer

torch.set_num_threads(1)


@pytest.mark.parametrize("tied", [False, True])
def test_matmul_parameters_leave_out_the_lookups_and_count_the_head_once(tied):
    cfg = ModelConfig(vocab_size=50, context_length=8, d_model=16, n_layers=2, n_heads=2,
                      d_ff=24, tie_embeddings=tied)
    model = TransformerLM(cfg)
    # Per block: qkv 3d^2, proj d^2, SwiGLU 3 d d_ff, two norm weights; then norm_f, head.
    d, f = 16, 24
    per_block = 4 * d * d + 3 * d * f + 2 * d
    expected = 2 * per_block + d + 50 * d
    assert matmul_parameters(model) == expected
    flops = training_flops_per_token(cfg, expected)
    assert flops == 6 * expected + 12 * 2 * 16 * 8


def test_peak_table_and_absent_peaks():
    assert peak_for_name("NVIDIA H200").flops == 989e12
    assert peak_for_name("NVIDIA H100 80GB HBM3").flops == 989e12
    assert peak_for_name("NVIDIA H100 PCIe").flops == 756e12
    assert peak_for_name("NVIDIA A100-SXM4-80GB").flops == 312e12
    assert peak_for_name("Some Future GPU") is None
    assert device_peak("cpu") is None
    peak = Peak("test", 100.0)
    assert mfu(10.0, 4.0, peak) == pytest.approx(0.4)
    assert mfu(10.0, 4.0, peak, devices=2) == pytest.approx(0.2)
    assert mfu(10.0, 4.0, None) is None and mfu(0.0, 4.0, peak) is None


def _settings(data, out, **kw) -> TrainSettings:
    model = ModelConfig(context_length=16, d_model=32, n_layers=2, n_heads=2, d_ff=64)
    fields = dict(model=model, data=str(data), steps=5, batch_size=4, eval_every=0,
                  eval_batches=1, out=str(out), sample_tokens=0, quiet=True, plot=False,
                  ddp="none", sharding="none", log_every=2)
    fields.update(kw)
    return TrainSettings(**fields).validate(1)


def test_mfu_is_absent_on_the_cpu_and_reported_with_a_known_peak(corpus_dir, tmp_path,
                                                                  monkeypatch):
    summary = Trainer(_settings(corpus_dir, tmp_path / "cpu"), DistContext()).run()
    assert summary["mfu"] is None and summary["mfu_peak"] is None
    records = [json.loads(x) for x in (tmp_path / "cpu" / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert all("mfu" not in r for r in records)

    # A made-up device peak: the records and the summary carry MFU against it.
    monkeypatch.setattr(train_module, "device_peak", lambda device: Peak("test peak", 1e9))
    trainer = Trainer(_settings(corpus_dir, tmp_path / "peak"), DistContext())
    summary = trainer.run()
    records = [json.loads(x) for x in (tmp_path / "peak" / "metrics.jsonl").open()]
    for r in records:
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * trainer.flops_per_token / 1e9)
    assert summary["mfu"] == pytest.approx(
        summary["step_tokens_per_s"] * summary["flops_per_token"] / 1e9)
    assert summary["mfu_peak"].startswith("test peak")
    saved = json.loads((tmp_path / "peak" / "summary.json").read_text())
    assert saved["mfu"] == pytest.approx(summary["mfu"])
