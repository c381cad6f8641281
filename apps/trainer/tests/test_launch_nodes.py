"""One launch path: the trainer run as 2 nodes x 2 ranks on one machine, by two ``torchrun``
agents meeting through a c10d rendezvous on localhost (Gloo ranks on the CPU), trains and
checkpoints; the checkpoint resumes as 1 node x 2 ranks (``lab2-train --nproc 2``, the same
elastic agent in-process); the losses are those of ``lab2-train --nproc 4``.

The learning rate is constant (no warm-up, ``--min-lr`` = ``--lr``) so that a run of 3 steps
extended to 6 follows the same schedule as a run of 6. It starts its own four ranks: run
once, in the world-size-4 cell of the Gloo matrix.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gloo, pytest.mark.slow,
              pytest.mark.skipif(sys.platform != "linux", reason="Gloo ranks on Linux")]

TINY = ["--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--d-ff", "64",
        "--context-length", "32", "--batch-size", "8", "--eval-batches", "1",
        "--eval-every", "0", "--sample-tokens", "0", "--quiet", "--no-plot", "--log-every", "1",
        "--lr", "1e-2", "--min-lr", "1e-2", "--warmup", "0", "--ddp", "bucketed",
        "--sharding", "zero1-allreduce", "--bucket-mb", "0.01", "--timeout", "120"]
CLI = [sys.executable, "-c", "import sys; from lab2_trainer.cli.main import main; sys.exit(main())"]
RUN_S = 300  # four fresh interpreters importing torch on a loaded 2-core machine


def _env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _losses(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _run(cmd: list[str], tmp: Path) -> subprocess.CompletedProcess:
    run = subprocess.run(cmd, env=_env(tmp), capture_output=True, text=True, timeout=RUN_S)
    assert run.returncode == 0, run.stderr[-4000:]
    return run


def _two_nodes(args: list[str], tmp: Path) -> None:
    """Two torchrun agents of two ranks each, one per "node", on this machine."""
    port = _free_port()
    agents = []
    try:
        for node in range(2):
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                 "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                 f"localhost:{port}", "--rdzv-id", f"lab2-two-nodes-{port}",
                 "--rdzv-conf", "join_timeout=120", "--node-rank", str(node),
                 "--max-restarts", "0", "-m", "lab2_trainer.cli", *args],
                env=_env(tmp), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                start_new_session=True))
        errors = [agent.communicate(timeout=RUN_S)[1] for agent in agents]
        for agent, err in zip(agents, errors):
            assert agent.returncode == 0, err[-4000:]
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait(timeout=30)


def test_two_torchrun_nodes_train_checkpoint_and_resume_as_one_node(world_size, corpus_dir,
                                                                     tmp_path):
    if world_size != 4:
        pytest.skip("the scenario is four ranks")
    data = ["--data", str(corpus_dir)]
    reference = tmp_path / "nproc4"
    _run([*CLI, *TINY, *data, "--steps", "6", "--nproc", "4", "--out", str(reference)],
         tmp_path)
    nodes = tmp_path / "nodes"
    _two_nodes([*TINY, *data, "--steps", "3", "--out", str(nodes)], tmp_path)
    assert sorted(_losses(nodes)) == [1, 2, 3]
    settings = (nodes / "settings.toml").read_text()
    assert "nproc = 4" in settings, settings
    # The four ranks' checkpoint, resumed by one node of two local ranks.
    _run([*CLI, "--resume", str(nodes), "--steps", "6", "--nproc", "2"], tmp_path)
    got, expected = _losses(nodes), _losses(reference)
    assert sorted(got) == sorted(expected) == list(range(1, 7))
    for step in expected:
        assert abs(got[step] - expected[step]) <= 1e-5 * abs(expected[step]), (step, got,
                                                                                expected)
    assert not list(tmp_path.glob("lab2-train-rdzv-*"))
