"""The launcher's verdict names the rank that ended the run, not the ranks the elastic agent
stopped after it, whichever of their ends the launch watch happened to see first."""

from __future__ import annotations

import signal
import time
from types import SimpleNamespace

from lab2_trainer.runtime.supervise import EXIT_TERMINATED, LaunchWatch, RankEnd


def _watch(tmp_path, nproc=2):
    watch = LaunchWatch(str(tmp_path), nproc, timeout_s=5.0)  # not started: no thread
    watch.pids = {rank: 10_000 + rank for rank in range(nproc)}
    return watch


def test_a_killed_rank_the_agent_reaped_first_is_the_cause(tmp_path):
    # The watch saw only rank 0 end, by the agent's SIGTERM; the agent had reaped rank 1,
    # killed by SIGKILL, before the watch could read its end.
    watch = _watch(tmp_path)
    watch.ends[0] = RankEnd(EXIT_TERMINATED, None, time.monotonic())
    lines, code = watch.verdict({1: SimpleNamespace(exitcode=-signal.SIGKILL, pid=10_001)})
    assert code == 1, (lines, code)
    assert any("rank 1 (pid 10001)" in line and "SIGKILL" in line for line in lines), lines
    assert not any("SIGTERM" in line for line in lines), lines


def test_a_failing_rank_the_agent_reaped_first_gives_its_code(tmp_path):
    watch = _watch(tmp_path, nproc=3)
    now = time.monotonic()
    watch.ends[0] = RankEnd(EXIT_TERMINATED, None, now)
    watch.ends[2] = RankEnd(EXIT_TERMINATED, None, now + 0.01)
    lines, code = watch.verdict({1: SimpleNamespace(exitcode=2, pid=10_001)})
    assert code == 2, (lines, code)
    assert not any("SIGTERM" in line for line in lines), lines


def test_a_rank_stopped_alone_by_sigterm_is_named(tmp_path):
    # A SIGTERM to one rank, before anything else failed: it stopped in order, and says so.
    watch = _watch(tmp_path)
    now = time.monotonic()
    watch.ends[0] = RankEnd(EXIT_TERMINATED, None, now)
    watch.ends[1] = RankEnd(EXIT_TERMINATED, None, now + 0.5)
    lines, code = watch.verdict({0: SimpleNamespace(exitcode=EXIT_TERMINATED, pid=10_000)})
    assert code == EXIT_TERMINATED, (lines, code)
    assert lines[0] == "rank 0 (pid 10000) was stopped by SIGTERM", lines


def test_a_clean_exit_does_not_move_the_reaped_rank_before_it(tmp_path):
    # Rank 0 finished cleanly earlier; rank 2 got the agent's SIGTERM after rank 1 was
    # killed. Rank 1 goes just before rank 2's end, not before rank 0's.
    watch = _watch(tmp_path, nproc=3)
    now = time.monotonic()
    watch.ends[0] = RankEnd(0, None, now - 10.0)
    watch.ends[2] = RankEnd(EXIT_TERMINATED, None, now)
    lines, code = watch.verdict({1: SimpleNamespace(exitcode=-signal.SIGKILL, pid=10_001)})
    assert code == 1 and not any("SIGTERM" in line for line in lines), (lines, code)
    assert watch.ends[0].at < watch.ends[1].at < watch.ends[2].at
