"""``--tp`` and ``--sequence-parallel`` through the real command line: what cannot work is
refused before any rank starts (exit code 2, one stderr line naming it, nothing written),
and the defaults of the rank layout follow the data-parallel ranks, not the world.

The first case runs ``lab2-train`` in a subprocess; the others go through ``main()`` in
this process (the same code path, without a torch import per case)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lab2_testing.cli import folder_listing, one_error_line, refused_here
from lab2_trainer.config import TrainSettings, model_config

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
    (["--tp", "2", "--nproc", "2", "--ckpt-every", "1"],
     ("--tp 2 does not write checkpoints yet", "--ckpt-every")),
    (["--tp", "2", "--nproc", "2", "--resume", "nowhere"],
     ("--tp 2 cannot resume from a checkpoint yet",)),
], ids=["heads", "d-ff", "vocab", "sequence", "sp-without-tp", "ckpt-every", "resume"])
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
