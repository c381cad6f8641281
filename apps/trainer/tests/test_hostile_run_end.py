"""Run integrity, third pass (issue 39): rank 0's work alone past ``--timeout``, a rank
that dies, and failures that were tracebacks. Real processes (the launcher forks Gloo
ranks), real signals; the exit code, the stderr lines and what is left on disk.

7. rank 0's end of the run (a long sample) and its checkpoint writes are not bounded by
   ``--timeout``; a rank 0 frozen in them is still named.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lab2_trainer.rank0_alone import rank0_alone

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")]

#: The review's tiny run.
B = ["--steps", "3", "--batch-size", "4", "--d-model", "32", "--n-layers", "1", "--n-heads",
     "2", "--d-ff", "64", "--context-length", "32", "--eval-batches", "1", "--eval-every", "0",
     "--sample-tokens", "0", "--no-plot", "--quiet"]
CLI = [sys.executable, "-c", "import sys; from lab2_trainer.cli import main; sys.exit(main())"]
START_S = 180  # a fresh interpreter importing torch on a loaded 2-core machine


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["TMPDIR"] = str(tmp)  # the rendezvous folder goes here, where we can look
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def lab2_train(args: list[str], tmp: Path, timeout: float = 2 * START_S):
    return subprocess.run([*CLI, *args], cwd=tmp, env=_env(tmp), capture_output=True,
                          text=True, timeout=timeout)


# ------------------------------------------------------------------ 7. rank 0 alone
def test_7_a_sample_longer_than_the_timeout_ends_a_healthy_run(corpus_dir, tmp_path):
    out = tmp_path / "run"
    proc = lab2_train([*B, "--data", str(corpus_dir), "--nproc", "2", "--timeout", "2",
                       "--sample-tokens", "6000", "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert sorted(p.name for p in out.iterdir()) == [
        "ckpt.pt", "metrics.jsonl", "sample.txt", "settings.toml", "summary.json"]
    assert len((out / "sample.txt").read_text()) >= 6000
    assert not list(tmp_path.glob("lab2-train-rdzv-*"))


def _alone(ctx, how: str) -> None:
    def work() -> str:
        if how == "frozen":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(4)  # twice --timeout: legitimate work
        return "done"

    got = rank0_alone(ctx, "in the test's work", work, timeout_s=2)
    assert got == ("done" if ctx.is_main else None)
    torch.distributed.barrier()  # the ranks meet again after it


@pytest.mark.parametrize("how", ["working", "frozen"])
def test_7_rank0_work_alone_is_not_bounded_but_a_frozen_rank0_is_named(capfd, how):
    from lab2_trainer.launch import spawn_local

    start = time.monotonic()
    rc = spawn_local(2, "cpu", _alone, how, timeout_s=2)
    took = time.monotonic() - start
    err = capfd.readouterr().err
    if how == "working":
        assert rc == 0 and err == "", err
    else:
        lines = err.strip().splitlines()
        assert rc == 1 and took < 30, (rc, took, err)
        assert lines[-1].startswith("lab2-train: rank 0 (pid") and "stopped answering" in err
