"""Single-process training: loss falls, outputs are written, resume is bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lab2_testing.ddp_testkit import bitwise_equal
from lab2_trainer.config import ModelConfig, TrainSettings
from lab2_trainer.runtime.launch import DistContext
from lab2_trainer.training.loop import Trainer

torch.set_num_threads(1)



def tiny_settings(data: Path, out: Path, **overrides) -> TrainSettings:
    model = ModelConfig(context_length=32, d_model=32, n_layers=2, n_heads=2, d_ff=64)
    fields = dict(model=model, data=str(data), steps=6, batch_size=12, lr=1e-2, min_lr=1e-3,
                  warmup=2, eval_every=0, eval_batches=2, out=str(out), sample_tokens=0,
                  quiet=True, plot=False, ddp="none", sharding="none", seed=0)
    fields.update(overrides)
    return TrainSettings(**fields).validate(1)


def params_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_short_run_loss_falls_and_writes_every_output(corpus_dir, tmp_path):
    s = tiny_settings(corpus_dir, tmp_path / "run", steps=40, eval_every=20, sample_tokens=30,
                      quiet=False, plot=True)
    summary = Trainer(s, DistContext()).run()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == list(range(1, 41))
    losses = [r["loss"] for r in records]
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5, losses
    assert [r["step"] for r in records if "val_loss" in r] == [20, 40]
    assert summary["final_val_loss"] < records[0]["loss"] - 1.0
    for name in ("ckpt/step-000040/manifest.json", "loss_curve.png", "sample.txt",
                 "summary.json"):
        assert (tmp_path / "run" / name).is_file(), name
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["final_val_loss"] == pytest.approx(summary["final_val_loss"])
    assert (tmp_path / "run" / "sample.txt").read_text().startswith("def ")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resume_gives_bitwise_the_same_parameters(corpus_dir, tmp_path, precision):
    # grad_accum and clipping on, so the accumulation path is covered too.
    common = dict(steps=6, grad_accum=2, clip=0.5, precision=precision)
    straight = Trainer(tiny_settings(corpus_dir, tmp_path / "a", **common), DistContext())
    straight.run()
    first = Trainer(tiny_settings(corpus_dir, tmp_path / "b", **common), DistContext())
    first.run(stop_at=3)
    assert first.step == 3
    resumed = Trainer(
        tiny_settings(corpus_dir, tmp_path / "b", resume=str(tmp_path / "b"),
                      **common),
        DistContext(),
    )
    assert resumed.step == 3
    resumed.run()
    a, b = params_of(straight), params_of(resumed)
    assert bitwise_equal(a, b), [k for k in a if not torch.equal(a[k], b[k])]
    # The metrics file holds each step once, the resumed steps with the same losses.
    ra = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").open()]
    rb = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").open()]
    assert [r["step"] for r in rb] == list(range(1, 7))
    assert [r["loss"] for r in ra] == [r["loss"] for r in rb]
