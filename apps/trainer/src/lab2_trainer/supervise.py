"""The trainer's side of rank supervision.

The mechanics (parent-death signal, heartbeats, SIGTERM handled like Ctrl-C, the
rendezvous folder removed by an orphaned rank) live in :mod:`lab2bench.supervise`, shared
with every local rank launcher; this module re-exports them and adds the run-specific
verdict: which rank stopped answering, in the words of ``lab2-train``'s ``--timeout``.
"""

from __future__ import annotations

from typing import Any

from lab2bench.supervise import (
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    FAILED,
    HEARTBEAT_INTERVAL_S,
    ORPHAN_GRACE_S,
    RUNNING,
    TIMED_OUT,
    RankGuard,
    Terminated,
    exit_code_for,
    install_termination_handler,
    is_timeout_error,
    restore_termination_handler,
    set_parent_death_signal,
)
from lab2bench.supervise import RankWatch as _RankWatch

__all__ = [
    "EXIT_INTERRUPTED", "EXIT_TERMINATED", "FAILED", "HEARTBEAT_INTERVAL_S", "ORPHAN_GRACE_S",
    "RUNNING", "TIMED_OUT", "RankGuard", "RankWatch", "Terminated", "exit_code_for",
    "install_termination_handler", "is_timeout_error", "restore_termination_handler",
    "set_parent_death_signal",
]


class RankWatch(_RankWatch):
    """:class:`lab2bench.supervise.RankWatch` that explains a failed run."""

    def explain_stop(self, procs: list[Any], timeout_s: float) -> str | None:
        """One line naming the rank(s) that stopped answering, when that is why the run
        failed (None when the failure was something else)."""
        import time

        now = time.monotonic()
        stale = max(4 * HEARTBEAT_INTERVAL_S + 1.0, min(timeout_s, 10.0))
        frozen = [(r, self.silence(r, now)) for r, p in enumerate(procs)
                  if p.exitcode is None and (self.silence(r, now) or 0.0) > stale]
        if frozen:
            names = ", ".join(f"rank {r} (pid {procs[r].pid}, no heartbeat for {q:.0f} s)"
                              for r, q in frozen)
            return f"{names} stopped answering: stopped or frozen"
        timed_out = [r for r in range(len(procs)) if self.status[r] == TIMED_OUT]
        if not timed_out:
            return None
        waiting = ", ".join(map(str, timed_out))
        others = [r for r, p in enumerate(procs)
                  if r not in timed_out and self.status[r] == RUNNING
                  and (p.exitcode is None or p.exitcode == 0)]
        if others:
            names = ", ".join(f"rank {r} (pid {procs[r].pid})" for r in others)
            return (f"{names} stopped answering: rank(s) {waiting} gave up waiting for it in "
                    f"a collective after --timeout {timeout_s:g} s (it is alive but stuck "
                    "elsewhere)")
        return (f"rank(s) {waiting} timed out after --timeout {timeout_s:g} s waiting for "
                "each other in a collective")
