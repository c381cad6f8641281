"""A rank that dies in the middle of zero1's reduce-scatters ends the run, named, within
``--timeout``: the survivors are not left waiting in a collective.

* in process: rank 1 kills itself (SIGKILL) from inside backward, after its first buckets'
  reductions have started and before the last one has: rank 0 is inside the step's
  reductions when it happens;
* the real ``lab2-train --sharding zero2`` on 2 Gloo ranks: rank 1 killed from outside
  while the run trains.
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
from torch import nn

from lab2_testing.procs import children, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux",
                                                   reason="reads /proc")]

START_S = 120  # a fresh interpreter importing torch on a loaded 2-core machine


def _dies_mid_reduce_scatter(ctx, stage: int) -> None:
    from zero1 import ShardedOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
    # Buckets of about one layer each: six reductions per backward, issued as the layers'
    # gradients arrive (last layer first).
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, stage=stage,
                           bucket_size_mb=16 * 17 * 4 / 2**20)
    if ctx.rank == 1:
        # The first layer's gradient comes last: the later layers' buckets are on the wire.
        model[0].weight.register_post_accumulate_grad_hook(
            lambda _p: os.kill(os.getpid(), signal.SIGKILL))
    for _ in range(3):
        loss = model(torch.randn(8, 16)).square().mean()
        loss.backward()
        opt.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()


@pytest.mark.gloo
@pytest.mark.parametrize("stage", [1, 2])
def test_a_rank_killed_mid_reduce_scatter_is_named(capfd, stage):
    from lab2_trainer.runtime.launch import spawn_local

    start = time.monotonic()
    rc = spawn_local(2, "cpu", _dies_mid_reduce_scatter, stage, timeout_s=5)
    took = time.monotonic() - start
    err = capfd.readouterr().err
    assert rc == 1 and took < 30, (rc, took, err)
    assert "rank 1 (pid" in err and "was killed by SIGKILL" in err, err
    assert "Traceback" not in err, err


# ------------------------------------------------------------------ the real command
TINY = ["--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--d-ff", "64",
        "--context-length", "32", "--batch-size", "8", "--eval-batches", "2",
        "--sample-tokens", "0", "--quiet", "--no-plot", "--nproc", "2", "--eval-every", "0",
        "--sharding", "zero2", "--bucket-mb", "0.01"]


def _trained_steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def test_lab2_train_zero2_names_a_killed_rank_within_the_timeout(corpus_dir, tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from lab2_trainer.cli.main import main; "
         "sys.exit(main())", *TINY, "--data", str(corpus_dir), "--steps", "100000",
         "--log-every", "1", "--timeout", "5", "--out", str(out)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        wait_for(lambda: _trained_steps(out) >= 2, START_S, "the first steps", proc)
        ranks = wait_for(lambda: children(proc.pid, count=2), 10, "the ranks", proc)
        os.kill(ranks[1], signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(timeout=60)
        took = time.monotonic() - killed
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == 1, err
    assert f"rank 1 (pid {ranks[1]}" in err and "SIGKILL" in err, err
    assert "Traceback" not in err, err
    assert took < 30, took
    assert not list(tmp_path.glob("lab2-train-rdzv-*"))
