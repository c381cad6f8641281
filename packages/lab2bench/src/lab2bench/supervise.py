"""Ranks that die with their launcher, SIGTERM handled like Ctrl-C, and heartbeats that let
the launcher (:mod:`lab2bench.ranks`) name the rank which stopped answering.

* Every local rank asks the kernel for a parent-death signal (``prctl(PR_SET_PDEATHSIG,
  SIGTERM)`` through ctypes, on Linux) and runs a small thread that, twice a second,
  writes a heartbeat into shared memory and checks that its launcher is still its
  parent (the liveness check that also works where there is no ``prctl``). A rank whose
  launcher is gone shuts down as on SIGTERM, removes the rendezvous folder the launcher
  can no longer remove, and is gone within :data:`ORPHAN_GRACE_S` seconds of noticing
  (one heartbeat at most: 4.5 s in all) whatever it was doing. An orphaned rank also
  continues its peers (SIGCONT), so that one stopped with SIGSTOP acts on its own
  parent-death signal instead of staying behind, stopped, for ever.
* SIGTERM raises :class:`Terminated`, a ``KeyboardInterrupt``: the launcher and the
  ranks take the same orderly path as on Ctrl-C (the last checkpoint stays intact; a
  checkpoint being written is abandoned, its temporary file removed).
* The launcher reads the heartbeats: a rank that has given no sign of life for a given
  time (stopped with SIGSTOP, frozen) ends the run, named; a rank that fails marks its
  status (a collective that timed out, or another failure) for the launcher's message.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import sys
import threading
import time
from typing import Any

PR_SET_PDEATHSIG = 1
HEARTBEAT_INTERVAL_S = 0.5
# An orphan's orderly stop gets this long before os._exit; with the heartbeat that notices
# the launcher gone, a rank is gone within 5 s of its launcher, even one blocked in a
# collective (where a signal's Python handler cannot run).
ORPHAN_GRACE_S = 4.0
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_TERMINATED = 143  # 128 + SIGTERM

# Per-rank status the launcher reads when a run fails.
RUNNING, TIMED_OUT, FAILED = 0, 1, 2


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: stop as on Ctrl-C."""


def _raise_terminated(signum: int, frame: Any) -> None:
    # Once is enough: a second SIGTERM must not interrupt the shutdown itself.
    signal.signal(signal.SIGTERM, _ignore)
    raise Terminated(f"stopped by {signal.Signals(signum).name}")


def _ignore(signum: int, frame: Any) -> None:
    pass


_stopping = False


def _rank_stop(signum: int, frame: Any) -> None:
    # A rank stops once: the launcher's SIGTERM after Ctrl-C (or a second Ctrl-C) must not
    # interrupt the shutdown the first one started (the launcher escalates to SIGKILL).
    # (A handler that returns, not SIG_IGN: a signal already pending when the disposition
    # changed would surface as "OSError: Signal 15 ignored due to race condition".)
    global _stopping
    if _stopping:
        return
    _stopping = True
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(f"stopped by {signal.Signals(signum).name}")


def install_termination_handler(*, rank: bool = False) -> Any:
    """SIGTERM raises :class:`Terminated` in the main thread; returns the old handler
    (None when not on the main thread, where signals cannot be handled).

    Args:
        rank: in a rank, the first SIGTERM or Ctrl-C also ignores every later one.
    """
    if threading.current_thread() is not threading.main_thread():
        return None
    if rank:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _rank_stop)
        return signal.signal(signal.SIGTERM, _rank_stop)
    return signal.signal(signal.SIGTERM, _raise_terminated)


def restore_termination_handler(previous: Any) -> None:
    """Put back what :func:`install_termination_handler` replaced."""
    if previous is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, previous)


def exit_code_for(interrupt: BaseException) -> int:
    """143 for SIGTERM, 130 for Ctrl-C."""
    return EXIT_TERMINATED if isinstance(interrupt, Terminated) else EXIT_INTERRUPTED


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies; False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def is_timeout_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective (or rendezvous) that gave up waiting."""
    text = f"{type(exc).__name__}: {exc}".lower()
    return "timed out" in text or "timeout" in text


class RankWatch:
    """Shared memory between the launcher and its ranks: heartbeats and statuses.

    Built by the launcher before the ranks start and passed to each rank (it pickles for
    spawned ranks too).

    Args:
        ctx: the multiprocessing context the ranks are started from.
        nproc: number of ranks.
        cleanup_dir: the rendezvous folder; an orphaned rank removes it.
        direct_children: the ranks are this process's children (fork, spawn). With a
            forkserver they are the server's, which exits when this process does; a
            rank then watches the parent it started with.
    """

    def __init__(self, ctx: Any, nproc: int, cleanup_dir: str | None, *,
                 direct_children: bool = True) -> None:
        self.beats = ctx.RawArray("d", nproc)
        self.status = ctx.RawArray("i", nproc)
        self.pids = ctx.RawArray("i", nproc)  # each rank's, for its peers when orphaned
        self.parent_pid = os.getpid() if direct_children else None
        self.cleanup_dir = cleanup_dir
        self.started = time.monotonic()

    # ---------------------------------------------------------------- rank side
    def start_rank(self, rank: int) -> RankGuard:
        """In the rank: die with the launcher, beat, handle SIGTERM."""
        self.pids[rank] = os.getpid()
        guard = RankGuard(self, rank)
        guard.start()
        return guard

    def mark(self, rank: int, status: int) -> None:
        self.status[rank] = status

    # ---------------------------------------------------------------- launcher side
    def silence(self, rank: int, now: float | None = None) -> float | None:
        """Seconds since ``rank``'s last heartbeat (None before its first one)."""
        beat = self.beats[rank]
        if beat == 0.0:
            return None
        return (time.monotonic() if now is None else now) - beat

    def silent_ranks(self, procs: list[Any], limit_s: float) -> list[tuple[int, float]]:
        """Live ranks whose last heartbeat is older than ``limit_s``."""
        now = time.monotonic()
        out = []
        for rank, p in enumerate(procs):
            quiet = self.silence(rank, now)
            if p.exitcode is None and quiet is not None and quiet > limit_s:
                out.append((rank, quiet))
        return out


class RankGuard:
    """One rank's side of :class:`RankWatch`: the parent-death signal, the SIGTERM
    handler and the heartbeat/parent-liveness thread."""

    def __init__(self, watch: RankWatch, rank: int) -> None:
        self.watch = watch
        self.rank = rank
        self.parent_pid = watch.parent_pid or os.getppid()
        self.orphaned = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        set_parent_death_signal(signal.SIGTERM)
        install_termination_handler(rank=True)
        self.watch.beats[self.rank] = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="lab2-rank-watch", daemon=True)
        self._thread.start()
        if os.getppid() != self.parent_pid:  # the launcher died before prctl
            self._orphan()

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_INTERVAL_S):
            self.watch.beats[self.rank] = time.monotonic()
            if os.getppid() != self.parent_pid and not self.orphaned:
                self._orphan()

    def _orphan(self) -> None:
        """The launcher is gone: stop as on SIGTERM, and be gone within the grace time.
        A peer stopped with SIGSTOP would never act on its own parent-death signal (nor
        be reaped): it is continued, so that it stops in order too."""
        self.orphaned = True
        for pid in list(self.watch.pids):
            if pid > 0 and pid != os.getpid():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGCONT)
        with contextlib.suppress(OSError):
            os.kill(os.getpid(), signal.SIGTERM)
        threading.Thread(target=self._last_resort, name="lab2-rank-exit", daemon=True).start()

    def _last_resort(self) -> None:
        time.sleep(ORPHAN_GRACE_S)
        self.remove_rendezvous()
        os._exit(EXIT_TERMINATED)

    def remove_rendezvous(self) -> None:
        if self.watch.cleanup_dir:
            shutil.rmtree(self.watch.cleanup_dir, ignore_errors=True)

    def stop(self) -> None:
        """On the rank's way out: stop beating; clean up after a launcher that is gone."""
        self._stop.set()
        if self.orphaned or os.getppid() != self.parent_pid:
            self.orphaned = True
            self.remove_rendezvous()
