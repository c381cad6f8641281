"""``--profile-steps A:B``: a tiny CPU run writes a Chrome trace of exactly those steps into
its folder, and a bad range is refused in one line before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lab2_testing.cli import folder_listing
from lab2_trainer.cli.main import main
from lab2_trainer.config import ModelConfig, TrainSettings
from lab2_trainer.reporting.profiling import trace_name
from lab2_trainer.runtime.launch import DistContext
from lab2_trainer.training.loop import Trainer

torch.set_num_threads(1)


def traced_steps(path: Path) -> list[int]:
    trace = json.loads(path.read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    return sorted(int(n.rsplit(" ", 1)[1]) for n in names if n.startswith("train step "))


def test_the_trace_of_steps_a_to_b_is_written_into_the_run_folder(corpus_dir, tmp_path):
    out = tmp_path / "run"
    model = ModelConfig(context_length=16, d_model=16, n_layers=1, n_heads=2, d_ff=32)
    s = TrainSettings(model=model, data=str(corpus_dir), steps=4, batch_size=2, warmup=1,
                      eval_every=0, eval_batches=1, out=str(out), sample_tokens=0, quiet=True,
                      plot=False, ddp="none", sharding="none", profile_steps="2:3").validate(1)
    summary = Trainer(s, DistContext()).run()
    path = out / trace_name(2, 3, rank=0)
    assert summary["outputs"]["profile trace"] == str(path)
    assert traced_steps(path) == [2, 3]
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # no partial file
    split = summary["wall_clock"]
    assert sum(split[k] for k in split if k.endswith("_s") and k != "wall_s") == \
        pytest.approx(split["wall_s"])


@pytest.mark.parametrize(("value", "fragment"), [
    ("3", "--profile-steps must be A:B, two step numbers, got '3'"),
    ("a:b", "--profile-steps must be A:B"),
    ("0:2", "--profile-steps must be A:B with 1 <= A <= B, got '0:2'"),
    ("3:2", "with 1 <= A <= B"),
    ("2:9", "--profile-steps 2:9 ends after the run's last step (--steps 3)"),
])
def test_a_bad_range_is_refused_in_one_line(capsys, monkeypatch, tmp_path, value, fragment):
    monkeypatch.chdir(tmp_path)
    before = folder_listing(tmp_path)
    rc = main(["--steps", "3", "--nproc", "1", "--out", str(tmp_path / "run"),
               "--profile-steps", value])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("lab2-train: error: "), err
    assert fragment in lines[0], lines[0]
    assert folder_listing(tmp_path) == before, "something was written"
