"""The ``lab2-train`` command: a short run of the main command on 2 Gloo ranks, and bad
input answered by one line on stderr, exit code 2 and no file written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lab2_trainer.checkpoint.folders import load_trainer_state
from lab2_trainer.cli.main import main

torch.set_num_threads(1)

TINY = ["--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--d-ff", "64",
        "--context-length", "32", "--batch-size", "8", "--eval-batches", "2",
        "--sample-tokens", "0", "--quiet", "--no-plot"]



@pytest.fixture(scope="module")
def finished_run(corpus_dir, tmp_path_factory) -> Path:
    """A run folder with a checkpoint, made by the one-process path of the CLI."""
    out = tmp_path_factory.mktemp("runs") / "done"
    rc = main([*TINY, "--data", str(corpus_dir), "--nproc", "1", "--steps", "3",
               "--out", str(out)])
    assert rc == 0
    return out


def test_main_command_in_short_on_two_gloo_ranks(corpus_dir, tmp_path):
    """The README's main command (2 ranks, ShardedOptimizer reduce-scattering the gradients
    itself, no DDP wrapper: the default --sharding zero1), shortened."""
    out = tmp_path / "run"
    rc = main([*TINY, "--data", str(corpus_dir), "--nproc", "2", "--steps", "30", "--lr", "1e-2",
               "--warmup", "3", "--eval-every", "15", "--out", str(out)])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert "no DDP" in summary["setup"]
    assert "ShardedOptimizer(stage 1, reduce-scatter" in summary["setup"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    losses = [r["loss"] for r in records]
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < losses[0] - 1.5, losses
    assert summary["final_val_loss"] < losses[0] - 1.0
    assert summary["unigram_entropy"] > 0
    assert (out / "ckpt" / "step-000030" / "manifest.json").is_file()


def folder_bytes(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def run_bad(capsys, argv: list[str]) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("lab2-train: error: ")
    return lines[0]


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--n-heads", "5"], "n_heads=5 does not divide d_model=32"),
        (["--batch-size", "5", "--nproc", "2"], "not divisible by world_size x grad_accum"),
        (["--batch-size", "4", "--nproc", "8"], "cannot feed 8 rank(s)"),
        (["--nproc", "0"], "--nproc must be >= 1"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--ddp", "none", "--sharding", "none", "--nproc", "2"], "--ddp none cannot average"),
        (["--sharding", "zero2", "--ddp", "bucketed", "--nproc", "2"],
         "--sharding zero2 averages gradients itself, without a DDP wrapper: drop --ddp "
         "bucketed"),
        (["--sharding", "zero1", "--precision", "fp16", "--nproc", "2"],
         "--precision fp16 needs a gradient scaler"),
        (["--sharding", "fsdp", "--precision", "fp16", "--nproc", "2"], "use bf16"),
        (["--sharding", "torch", "--ddp", "none", "--nproc", "2"],
         "--sharding torch needs a --ddp variant"),
        (["--context-length", "100000"], "fewer than one window"),
    ],
)
def test_bad_options_give_one_line_and_write_nothing(capsys, corpus_dir, tmp_path, extra,
                                                     fragment):
    line = run_bad(capsys, [*TINY, "--data", str(corpus_dir), "--out", str(tmp_path / "o"),
                            *extra])
    assert fragment in line
    assert not (tmp_path / "o").exists()


def test_missing_data_path(capsys, tmp_path):
    line = run_bad(capsys, [*TINY, "--data", str(tmp_path / "missing"), "--out",
                            str(tmp_path / "o")])
    assert "data path does not exist" in line and not (tmp_path / "o").exists()


def test_corrupt_checkpoint_is_refused(capsys, tmp_path):
    bad = tmp_path / "ckpt.pt"
    bad.write_bytes(b"\x00garbage" * 100)
    line = run_bad(capsys, [*TINY, "--resume", str(bad)])
    assert "cannot read checkpoint" in line
    assert bad.read_bytes() == b"\x00garbage" * 100
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


def test_incompatible_checkpoint_and_existing_run_are_refused(capsys, corpus_dir, finished_run):
    before = folder_bytes(finished_run / "ckpt")
    metrics = (finished_run / "metrics.jsonl").read_text()
    line = run_bad(capsys, ["--resume", str(finished_run), "--d-model", "64"])
    assert "incompatible" in line and "d_model=32" in line
    line = run_bad(capsys, [*TINY, "--data", str(corpus_dir), "--out", str(finished_run)])
    assert "pass --resume" in line
    other = finished_run.parent / "other-data"
    other.mkdir()
    (other / "a.txt").write_text("x" * 5000)
    line = run_bad(capsys, ["--resume", str(finished_run), "--data", str(other)])
    assert "trained on" in line
    assert folder_bytes(finished_run / "ckpt") == before
    assert (finished_run / "metrics.jsonl").read_text() == metrics


def test_resume_extends_a_finished_run(corpus_dir, finished_run, tmp_path):
    out = tmp_path / "extended"
    rc = main(["--resume", str(finished_run / "ckpt" / "step-000003"), "--steps", "5",
               "--nproc", "1",
               "--out", str(out), "--quiet", "--no-plot", "--sample-tokens", "0"])
    assert rc == 0
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").open()]
    assert steps == [4, 5]
    saved = load_trainer_state(out / "ckpt" / "step-000005")
    assert saved["step"] == 5 and saved["model_config"]["d_model"] == 32
