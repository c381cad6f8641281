"""Run integrity, tried as a hostile user would: the real ``lab2-train`` command in
subprocesses, real signals, real files (Gloo ranks on the CPU; every wait has a deadline).

* two runs into one ``--out``: the second is refused, the first keeps its results;
* the launcher killed with SIGTERM or SIGKILL: no rank outlives it by more than a few
  seconds, no rendezvous folder is left; a stale claim and stale temporary files are
  cleaned up by the next run;
* a rank stopped with SIGSTOP: the run ends after ``--timeout``, naming it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lab2_testing.procs import children, running, wait_for
from lab2_trainer.checkpoint.folders import load_trainer_state, newest_step, verify
from lab2_trainer.cli.main import main

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux",
                                                   reason="reads /proc")]

TINY = ["--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--d-ff", "64",
        "--context-length", "32", "--batch-size", "8", "--eval-batches", "2",
        "--sample-tokens", "0", "--quiet", "--no-plot", "--nproc", "2", "--eval-every", "0"]
START_S = 120  # a fresh interpreter importing torch on a loaded 2-core machine


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["TMPDIR"] = str(tmp)  # the rendezvous folder goes here, where we can look
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _launch(args: list[str], tmp: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-c", "import sys; from lab2_trainer.cli.main import main; "
           "sys.exit(main())", *args]
    # Its own session (a terminal's process group, for Ctrl-C), with SIGINT's default
    # action even where this test runs with SIGINT ignored.
    return subprocess.Popen(cmd, env=_env(tmp), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def _stop(proc: subprocess.Popen, ranks: list[int]) -> None:
    for pid in [proc.pid, *ranks]:
        if running(pid):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _training_run(corpus: Path, out: Path, tmp: Path, *extra: str):
    """Start a long run and wait until it trains; returns (process, rank pids)."""
    proc = _launch([*TINY, "--data", str(corpus), "--steps", "100000", "--out", str(out),
                    *extra], tmp)
    try:
        wait_for(lambda: len(_steps(out)) >= 2, START_S, "the first steps", proc)
        ranks = wait_for(lambda: children(proc.pid, count=2), 10, "the ranks", proc)
    except BaseException:
        proc.kill()
        proc.wait(timeout=30)
        raise
    return proc, ranks


def test_second_run_into_a_claimed_folder_is_refused_and_the_first_keeps_its_results(
        corpus_dir, tmp_path):
    out = tmp_path / "run"
    first, ranks = _training_run(corpus_dir, out, tmp_path, "--ckpt-every", "2")
    try:
        second = subprocess.run(
            [sys.executable, "-c", "import sys; from lab2_trainer.cli.main import main; "
             "sys.exit(main())", *TINY, "--data", str(corpus_dir), "--steps", "8",
             "--ckpt-every", "2", "--seed", "1", "--out", str(out)],
            env=_env(tmp_path), capture_output=True, text=True, timeout=START_S)
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and f"pid {first.pid}" in lines[0], second.stderr
        assert "in use by another run" in lines[0]
        n = len(_steps(out))
        wait_for(lambda: len(_steps(out)) > n + 2, 60, "the first run to go on", first)
        # Ctrl-C's orderly stop, by SIGTERM: exit 143, the last checkpoint intact.
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=60) == 143
    finally:
        _stop(first, ranks)
    steps = _steps(out)
    assert steps == list(range(1, len(steps) + 1))  # one run's records, none lost
    newest = newest_step(out / "ckpt")
    verify(newest)  # every file of the newest complete checkpoint matches its manifest
    ckpt = load_trainer_state(newest)
    assert ckpt["settings"]["seed"] == 0 and ckpt["step"] % 2 == 0
    assert not (out / ".lab2-train.lock").exists()
    # a stopped run leaves its records, its checkpoints and its resolved settings, nothing else
    assert sorted(p.name for p in out.iterdir()) == ["ckpt", "metrics.jsonl", "settings.toml"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL, signal.SIGINT],
                         ids=["TERM", "KILL", "ctrl-c"])
def test_ranks_die_with_their_launcher(corpus_dir, tmp_path, sig):
    """SIGTERM and SIGKILL to the launcher alone; SIGINT to the whole process group, as a
    terminal's Ctrl-C sends it."""
    out = tmp_path / "run"
    launcher, ranks = _training_run(corpus_dir, out, tmp_path, "--ckpt-every", "2")
    try:
        wait_for(lambda: newest_step(out / "ckpt") is not None, 60, "a checkpoint", launcher)
        if sig == signal.SIGINT:
            os.killpg(launcher.pid, sig)
        else:
            os.kill(launcher.pid, sig)
        killed = time.monotonic()
        wait_for(lambda: not any(map(running, ranks)), 10, "the ranks to die")
        assert time.monotonic() - killed < 5
        launcher.wait(timeout=60)
        err = launcher.stderr.read()
    finally:
        _stop(launcher, ranks)
    assert launcher.returncode == {signal.SIGTERM: 143, signal.SIGINT: 130}.get(sig, -sig), err
    if sig != signal.SIGKILL:  # one line, no rank's traceback
        word = "stopped by SIGTERM" if sig == signal.SIGTERM else "interrupted"
        assert err.strip().splitlines() == [
            f"lab2-train: {word}: stopping the ranks; the last checkpoint is intact"], err
    assert not (out / "summary.json").exists()
    assert not list(tmp_path.glob("lab2-train-rdzv-*")), "rendezvous folder left behind"
    if sig == signal.SIGKILL:
        # The claim is left behind, stale; so is a temporary file of an interrupted write.
        # The next run (resuming here, one rank) takes both over and finishes.
        assert (out / ".lab2-train.lock").exists()
        stale = out / f".ckpt.pt.{ranks[0]}.tmp"
        stale.write_bytes(b"\0" * 4096)
        step = load_trainer_state(newest_step(out / "ckpt"))["step"]
        rc = main(["--resume", str(out), "--steps", str(step + 2), "--nproc", "1"])
        assert rc == 0
        assert not stale.exists() and not (out / ".lab2-train.lock").exists()
        assert load_trainer_state(newest_step(out / "ckpt"))["step"] == step + 2


def test_a_stopped_rank_is_named_after_the_timeout(corpus_dir, tmp_path):
    out = tmp_path / "run"
    launcher, ranks = _training_run(corpus_dir, out, tmp_path, "--timeout", "5")
    try:
        os.kill(ranks[1], signal.SIGSTOP)
        stopped = time.monotonic()
        launcher.wait(timeout=60)
        took = time.monotonic() - stopped
        err = launcher.stderr.read()
        wait_for(lambda: not any(map(running, ranks)), 10, "the ranks to die")
    finally:
        for pid in ranks:
            if running(pid):
                os.kill(pid, signal.SIGCONT)
        _stop(launcher, ranks)
    assert launcher.returncode == 1, err
    assert f"rank 1 (pid {ranks[1]}" in err and "stopped answering" in err, err
    assert took < 30, took
    assert not list(tmp_path.glob("lab2-train-rdzv-*"))


# ------------------------------------------------------------- the launcher's verdicts
def _stuck_or_killed(ctx, how: str) -> None:
    if ctx.rank == 1:
        if how == "stuck":
            time.sleep(60)  # alive, beating, but never joins the collective
        else:
            os.kill(os.getpid(), signal.SIGKILL if how == "killed" else signal.SIGTERM)
            time.sleep(60)
    torch.distributed.barrier()


@pytest.mark.parametrize("how", ["stuck", "killed", "terminated"])
def test_the_launcher_names_a_stuck_or_killed_rank(capfd, how):
    from lab2_trainer.runtime.launch import spawn_local

    start = time.monotonic()
    rc = spawn_local(2, "cpu", _stuck_or_killed, how, timeout_s=3)
    took = time.monotonic() - start
    err = capfd.readouterr().err
    assert rc in ((1, 143) if how == "terminated" else (1,)) and took < 30, (rc, took, err)
    if how == "stuck":
        assert "rank 0 gave up waiting for the other ranks after --timeout 3 s" in err, err
        assert "rank 1 (pid" in err and "alive but stuck elsewhere" in err, err
    elif how == "killed":
        assert "rank 1 (pid" in err and "was killed by SIGKILL" in err, err
    else:
        assert "rank 1 (pid" in err and "was stopped by SIGTERM" in err, err
