"""``--tp`` and ``--sequence-parallel`` through the real command line: what cannot work is
refused before any rank starts (exit code 2, one stderr line naming it, nothing written),
the defaults of the rank layout follow the data-parallel ranks, not the world, and a run at
``--tp 2`` writes checkpoints that resume at ``--tp 1`` and export to one file that a tp-1
model loads.

The first case runs ``lab2-train`` in a subprocess; the others go through ``main()`` in
this process (the same code path, without a torch import per case)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from lab2_testing.cli import folder_listing, one_error_line, refused_here
from lab2_trainer.config import ModelConfig, TrainSettings, model_config

#: A tiny run (4 heads, d_ff 64, context 32; the byte vocabulary of 256).
B = ["--steps", "2", "--batch-size", "4", "--d-model", "32", "--n-layers", "1", "--n-heads",
     "4", "--d-ff", "64", "--context-length", "32", "--eval-batches", "1", "--eval-every",
     "0", "--sample-tokens", "0", "--no-plot", "--quiet", "--device", "cpu"]
CMD = [sys.executable, "-c", "import sys; from lab2_trainer.cli.main import main; sys.exit(main())"]


def test_tp_that_does_not_divide_the_ranks_is_refused_by_the_real_command(tmp_path):
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    before = folder_listing(tmp_path)
    proc = subprocess.run([*CMD, *B, "--nproc", "3", "--tp", "2"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    one_error_line(proc.returncode, proc.stderr, ("--tp 2 does not divide the 3 ranks",))
    assert folder_listing(tmp_path) == before


@pytest.mark.parametrize(("extra", "fragments"), [
    (["--tp", "3", "--nproc", "3"], ("--tp 3 does not divide --n-heads 4",)),
    (["--tp", "4", "--nproc", "4", "--n-heads", "8", "--d-ff", "66"],
     ("--tp 4 does not divide --d-ff 66",)),
    (["--tp", "2", "--vocab-size", "255", "--nproc", "2"],
     ("--tp 2 does not divide --vocab-size 255",)),
    (["--tp", "4", "--nproc", "4", "--sequence-parallel", "--context-length", "30"],
     ("--sequence-parallel needs --tp 4 to divide --context-length 30",)),
    (["--sequence-parallel", "--nproc", "2"], ("--sequence-parallel", "give --tp > 1")),
], ids=["heads", "d-ff", "vocab", "sequence", "sp-without-tp"])
def test_what_tensor_parallelism_cannot_do_is_refused_before_any_rank_starts(
        capsys, monkeypatch, tmp_path, extra, fragments):
    refused_here(capsys, monkeypatch, [*B, *extra], tmp_path / "case", *fragments)


def test_the_layout_defaults_follow_the_data_parallel_ranks():
    model = model_config("tiny")
    # Two ranks, both tensor-parallel: one data-parallel rank, nothing to average.
    s = TrainSettings(model=model, tp=2).resolve(2)
    assert (s.sharding, s.ddp) == ("none", "none")
    s.validate(2)
    # Four ranks as dp 2 x tp 2: zero1 over the two data-parallel ranks.
    s = TrainSettings(model=model, tp=2).resolve(4)
    assert (s.sharding, s.ddp) == ("zero1", "none")
    s = TrainSettings(model=model, tp=2, sharding="none").resolve(4)
    assert s.ddp == "bucketed"
    s = TrainSettings(model=model, tp=4, ddp="none", sharding="none").resolve(4)
    s.validate(4)  # no data-parallel rank to average over
    with pytest.raises(ValueError, match="cannot average gradients over 2 data-parallel"):
        TrainSettings(model=model, tp=2, ddp="none", sharding="none").validate(4)
    assert TrainSettings(model=model, tp=2).data_parallel_size(6) == 3


def test_a_tp_run_checkpoints_resumes_at_another_tp_and_exports(capsys, monkeypatch, tmp_path):
    from lab2_trainer.cli.main import main
    from lab2_trainer.models.transformer import TransformerLM

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "tp2"
    assert main([*B, "--nproc", "2", "--tp", "2", "--sequence-parallel", "--ckpt-every", "1",
                 "--keep-last", "0", "--out", str(out)]) == 0
    step2 = out / "ckpt" / "step-000002"
    manifest = json.loads((step2 / "manifest.json").read_text())
    assert (manifest["version"], manifest["tp"], manifest["world_size"]) == (2, 2, 2)
    # Another --tp: tp 3 does not divide the heads, refused before any rank starts.
    refused_here(capsys, monkeypatch, ["--resume", str(step2), "--tp", "3", "--nproc", "3",
                                       "--steps", "3"], tmp_path / "refused",
                 "--tp 3 does not divide --n-heads 4")
    # At --tp 1 on one rank: sequence parallelism is dropped with the cut, the layout
    # chosen afresh.
    monkeypatch.chdir(tmp_path)
    assert main(["--resume", str(step2), "--tp", "1", "--nproc", "1", "--steps", "3"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 1 and "tensor" not in summary["setup"]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").open()][-1] == 3
    target = tmp_path / "tp2-step2.pt"
    assert main(["export", str(step2), str(target)]) == 0
    ckpt = torch.load(target, weights_only=True)
    model = TransformerLM(ModelConfig.from_dict(ckpt["model_config"]))  # tp 1: nothing cut
    model.load_state_dict(ckpt["model"], strict=True)
