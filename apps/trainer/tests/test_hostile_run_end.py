"""Run integrity, third pass (issue 39): rank 0's work alone past ``--timeout``, a rank
that dies, and failures that were tracebacks. Real processes (the launcher forks Gloo
ranks), real signals; the exit code, the stderr lines and what is left on disk.

7. rank 0's end of the run (a long sample) and its checkpoint writes are not bounded by
   ``--timeout``; a rank 0 frozen in them is still named.
12. a rank killed with SIGKILL: one line, the launcher's.
13. a checkpoint write that fails (a file-size limit: the disk-full path), a memory-mapped
    ``.bin`` truncated mid-run (SIGBUS), torchrun's agent killed: one line of ours each.
14. a damaged corpus cache is noticed (its checksum) and rebuilt.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from lab2_testing.procs import children, running, wait_for
from lab2_trainer.cli.main import main
from lab2_trainer.runtime.rank0_alone import rank0_alone

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")]

#: The review's tiny run.
B = ["--steps", "3", "--batch-size", "4", "--d-model", "32", "--n-layers", "1", "--n-heads",
     "2", "--d-ff", "64", "--context-length", "32", "--eval-batches", "1", "--eval-every", "0",
     "--sample-tokens", "0", "--no-plot", "--quiet"]
CLI = [sys.executable, "-c", "import sys; from lab2_trainer.cli.main import main; sys.exit(main())"]
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
        "ckpt", "metrics.jsonl", "sample.txt", "settings.toml", "summary.json"]
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
    from lab2_trainer.runtime.launch import spawn_local

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


# ------------------------------------------------------------- 12, 13. one line each
def _metrics(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _during_a_run(args: list[str], tmp: Path, act) -> tuple[int, list[str], list[int]]:
    """A long two-rank run in ``tmp``; once it trains, ``act(ranks)``; returns its exit
    code, its stderr lines and the rank pids."""
    out = tmp / "run"
    proc = subprocess.Popen([*CLI, *B, "--nproc", "2", "--steps", "100000", "--log-every", "1",
                             "--out", str(out), *args], cwd=tmp, env=_env(tmp),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        wait_for(lambda: _metrics(out) >= 2, START_S, "the first steps", proc)
        ranks = wait_for(lambda: children(proc.pid, count=2), 10, "the ranks", proc)
        act(ranks)
        proc.wait(timeout=60)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert not list(tmp.glob("lab2-train-rdzv-*"))
    return proc.returncode, err.strip().splitlines(), ranks


def test_12_a_killed_rank_is_one_line(corpus_dir, tmp_path):
    code, lines, ranks = _during_a_run(["--data", str(corpus_dir)], tmp_path,
                                       lambda ranks: os.kill(ranks[1], signal.SIGKILL))
    assert code == 1
    assert lines == [f"lab2-train: rank 1 (pid {ranks[1]}) was killed by SIGKILL"], lines


def test_13_a_truncated_memory_map_is_one_line(tmp_path):
    data = tmp_path / "tokens.bin"
    rng = np.random.default_rng(0)
    rng.integers(0, 256, 1 << 20, dtype=np.uint16).tofile(data)
    code, lines, _ = _during_a_run(["--data", str(data), "--vocab-size", "256"], tmp_path,
                                   lambda ranks: os.truncate(data, 0))
    assert code == 1
    assert len(lines) == 1 and "killed by SIGBUS (a bus error: most often a memory-mapped " \
        "file" in lines[0], lines
    assert "Fatal Python error" not in lines[0]


def test_13_a_checkpoint_write_that_fails_is_one_line(corpus_dir, tmp_path):
    """A file-size limit makes the checkpoint's write fail as a full disk does (a write
    refused with an OSError); the resumed run's last checkpoint stays intact."""
    out = tmp_path / "run"
    assert main([*B, "--data", str(corpus_dir), "--nproc", "1", "--steps", "2",
                 "--out", str(out)]) == 0
    (step,) = (out / "ckpt").glob("step-*")
    before = {p.name: p.read_bytes() for p in step.iterdir()}
    shards = max(len(v) for k, v in before.items() if k.endswith(".distcp"))
    small = max(len(v) for k, v in before.items() if not k.endswith(".distcp"))
    cap = shards // 4  # each of 2 ranks writes about half the state: over the cap
    assert cap > 4 * small

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (cap, cap))

    proc = subprocess.run([*CLI, *B, "--data", str(corpus_dir), "--nproc", "2", "--steps", "4",
                           "--resume", str(out)], cwd=tmp_path, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=2 * START_S,
                          preexec_fn=limit)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr
    assert len(lines) == 1, lines
    assert lines[0].startswith("lab2-train: rank 0 failed: checkpoint of step 4 was not "
                               "written (CheckpointException: ") and (
        "File too large" in lines[0] or "the file system refused a write" in lines[0]), lines
    assert "the previous one is intact" in lines[0]
    assert {p.name: p.read_bytes() for p in step.iterdir()} == before
    assert [p.name for p in (out / "ckpt").glob("step-*/manifest.json")] == ["manifest.json"]
    assert sorted(p.name for p in out.iterdir()) == ["ckpt", "metrics.jsonl", "settings.toml",
                                                     "summary.json"]


def test_13_torchrun_s_agent_killed_is_one_line_of_ours(corpus_dir, tmp_path):
    out = tmp_path / "run"
    env = {**_env(tmp_path), "OMP_NUM_THREADS": "1"}  # else torchrun warns about it
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "-m",
         "lab2_trainer.cli.main", *B, "--data", str(corpus_dir), "--steps", "100000",
         "--log-every", "1", "--out", str(out)], cwd=tmp_path, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for(lambda: _metrics(out) >= 2, 2 * START_S, "the first steps", agent)
        ranks = wait_for(lambda: children(agent.pid, count=2), 10, "the ranks", agent)
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait(timeout=30)
        wait_for(lambda: not any(map(running, ranks)), 30, "the ranks to stop")
        err = agent.stderr.read()  # every writer is gone: the whole of it
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait(timeout=30)
        for pid in children(agent.pid):
            os.kill(pid, signal.SIGKILL)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("lab2-train: rank 0 stopped: its launcher, torchrun's agent "
                               f"(pid {agent.pid}), is gone"), lines
    assert not (out / ".lab2-train.lock").exists()


# ----------------------------------------------------------------- 14. the corpus cache
def test_14_a_damaged_corpus_cache_is_noticed_and_rebuilt(monkeypatch, tmp_path):
    from lab2_trainer.data.corpus import load_stdlib_corpus

    cache = tmp_path / "cache"
    monkeypatch.setenv("LAB2_CACHE_DIR", str(cache))
    load_stdlib_corpus()
    (train,) = cache.glob("stdlib-*/train.npy")
    good = train.read_bytes()
    with open(train, "r+b") as f:  # same size, bytes overwritten inside
        f.seek(len(good) // 2)
        f.write(b"\0" * 64)
    proc = subprocess.run([*CLI, *B, "--nproc", "1", "--steps", "1", "--out", "run"],
                          cwd=tmp_path, env={**_env(tmp_path), "LAB2_CACHE_DIR": str(cache)},
                          capture_output=True, text=True, timeout=START_S)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 0, proc.stderr
    assert lines == [f"lab2-train: note: the corpus cache {train.parent} is damaged "
                     "(train.npy does not match its checksum); rebuilding it"], lines
    assert train.read_bytes() == good
    assert sorted(p.name for p in train.parent.iterdir()) == ["checksums.json", "train.npy",
                                                              "val.npy"]
