"""Supervision of the ranks: what ``lab2-train`` adds to torch.distributed's elastic
launcher, in the ranks (:class:`RankGuard`) and in the process that launches them
(:class:`LaunchWatch`). :mod:`lab2_trainer.runtime.launch` starts the ranks and uses both.

* **Ranks die with their launcher.** Every rank asks Linux for a parent-death signal
  (``prctl(PR_SET_PDEATHSIG, SIGTERM)`` through ctypes) and runs a small thread that,
  twice a second, beats and checks that its launcher is still its parent. A rank whose
  launcher is gone (SIGKILL included, which no launcher can pass on) continues its peers
  (SIGCONT: one stopped with SIGSTOP then acts on its own signal), stops as on SIGTERM,
  removes the run's watch folder and is gone within :data:`ORPHAN_GRACE_S` seconds
  whatever it was doing, even blocked in a collective.
* **SIGTERM is Ctrl-C.** It raises :class:`Terminated`, a ``KeyboardInterrupt``: the
  launcher and the ranks take the same orderly path (the last checkpoint stays intact).
* **The rank that stopped answering is named.** Local ranks (``--nproc``) share a watch
  folder with their launcher (``lab2-train-rdzv-*`` in the temporary folder): each rank
  writes its pid, touches its heartbeat file and, when it fails, writes why (a collective
  that timed out, a peer that went away, another failure). :class:`LaunchWatch`, a
  thread in the launcher, reads them: a rank without a heartbeat for ``--timeout``
  seconds is killed and named; every rank's end (exit code or signal) is read the
  moment it happens (``pidfd`` and ``waitid(WNOWAIT)``, leaving the reaping to the
  elastic agent), so that when the run fails :meth:`LaunchWatch.verdict` says which rank
  ended it and how. A folder that a killed launcher left is swept by the next launch.

Under ``torchrun`` the ranks keep the first two pieces (their launcher is torchrun's
agent); the third needs the launcher's side, so it is the local runs'. Nothing here
imports torch.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The process helpers the trainer shares with lab2bench (standard library only);
# OWNER_NAME is the file in a watch folder that names its launcher.
from lab2sys.processes import OWNER_NAME as OWNER_NAME
from lab2sys.processes import (
    set_parent_death_signal,
    sweep_stale_folders,
    write_owner,
)

# ----------------------------------------------------------- signals and exit codes
HEARTBEAT_INTERVAL_S = 0.5
#: An orphaned rank's orderly stop gets this long before ``os._exit``: with the heartbeat
#: that notices the launcher gone, a rank is gone within 5 s of its launcher.
ORPHAN_GRACE_S = 4.0
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_TERMINATED = 143  # 128 + SIGTERM

#: Why a rank failed, as it writes it in its status file.
TIMED_OUT, PEER_LOST, FAILED = "timed-out", "peer-lost", "failed"

#: Prefix of a local run's watch folder in the temporary folder.
WATCH_PREFIX = "lab2-train-rdzv-"


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
    # A rank stops once: the launcher's SIGTERM after Ctrl-C must not interrupt the
    # shutdown the first one started. (A handler that returns, not SIG_IGN: a signal
    # pending when the disposition changed would surface as "Signal 15 ignored".)
    global _stopping
    if _stopping:
        return
    _stopping = True
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(f"stopped by {signal.Signals(signum).name}")


def install_termination_handler(*, rank: bool = False) -> Any:
    """SIGTERM raises :class:`Terminated` in the main thread; returns the old handler
    (None off the main thread, where signals cannot be handled).

    Args:
        rank: in a rank: SIGINT too (unless ignored), and only the first of them counts.
    """
    if threading.current_thread() is not threading.main_thread():
        return None
    if rank:
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
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


# -------------------------------------------------------------- why a collective failed
#: How a collective reports that a peer went away (Gloo's TCP transport, NCCL).
_PEER_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe",
              "remote process exited", "socket closed")


def is_peer_lost_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that failed because another rank went away."""
    text = str(exc).lower()
    return isinstance(exc, (RuntimeError, OSError)) and any(s in text for s in _PEER_LOST)


def is_timeout_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective (or rendezvous) that gave up waiting."""
    text = f"{type(exc).__name__}: {exc}".lower()
    return "timed out" in text or "timeout" in text


#: What a fatal signal most often means for a rank, said after its name.
SIGNAL_HINTS = {
    signal.SIGBUS: "a bus error: most often a memory-mapped file, such as a --data token "
                   "array, truncated or removed while the run read it",
    signal.SIGSEGV: "a segmentation fault in native code",
}


def killed_line(ranks: list[tuple[int, Any]], number: int) -> str:
    """One line for the ranks (rank, pid) one signal killed, with what it most often means
    (run with PYTHONFAULTHANDLER=1 for the ranks' stacks)."""
    names = ", ".join(f"rank {r} (pid {p})" for r, p in ranks)
    hint = SIGNAL_HINTS.get(number)
    return (f"{names} {'was' if len(ranks) == 1 else 'were'} killed by {signal_name(number)}"
            + (f" ({hint})" if hint else ""))


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# ------------------------------------------------------------------------ watch folder
def sweep_stale_watch_folders(root: str | None = None) -> list[str]:
    """Remove the watch folders of launchers that are gone (killed before they could
    remove them, with a rank that could not either); returns the paths removed. A folder
    without a readable owner record, or another host's, is left alone."""
    return sweep_stale_folders((WATCH_PREFIX,), root)


def make_watch_folder() -> str:
    """A new watch folder naming this process as its owner (stale ones swept first)."""
    sweep_stale_watch_folders()
    folder = tempfile.mkdtemp(prefix=WATCH_PREFIX)
    write_owner(folder)
    return folder


def _pid_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}.pid")


def _beat_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}.beat")


def _status_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}.status")


def _write(path: str, text: str) -> None:
    with contextlib.suppress(OSError), open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


# ------------------------------------------------------------------------ rank side
class RankGuard:
    """One rank's side: the parent-death signal, SIGTERM as Ctrl-C, and the thread that
    beats (into the watch folder, when there is one) and checks its launcher.

    Args:
        rank: the global rank.
        folder: the run's watch folder (None under torchrun).
        launcher_pid: the launcher's pid, which must stay this process's parent (default:
            the parent now).
    """

    def __init__(self, rank: int, folder: str | None = None,
                 launcher_pid: int | None = None) -> None:
        self.rank = rank
        self.folder = folder
        self.parent_pid = launcher_pid or os.getppid()
        self.orphaned = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> RankGuard:
        set_parent_death_signal(signal.SIGTERM)
        install_termination_handler(rank=True)
        if self.folder:
            _write(_beat_file(self.folder, self.rank), "")
            _write(_pid_file(self.folder, self.rank), str(os.getpid()))
        self._thread = threading.Thread(target=self._run, name="lab2-rank-guard", daemon=True)
        self._thread.start()
        if os.getppid() != self.parent_pid:  # the launcher died before prctl
            self._orphan()
        return self

    def mark(self, status: str) -> None:
        """Say why this rank is failing, for the launcher's verdict."""
        if self.folder:
            _write(_status_file(self.folder, self.rank), status)

    def _beat(self) -> None:
        # Touch only: a file made here after an orphan removed the folder would keep it.
        if self.folder:
            with contextlib.suppress(OSError):
                os.utime(_beat_file(self.folder, self.rank))

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_INTERVAL_S):
            self._beat()
            if os.getppid() != self.parent_pid and not self.orphaned:
                self._orphan()

    def _peer_pids(self) -> list[int]:
        if not self.folder:
            return []
        pids = []
        for path in Path(self.folder).glob("rank*.pid"):
            text = _read(str(path))
            if text and text.isdigit() and int(text) != os.getpid():
                pids.append(int(text))
        return pids

    def _orphan(self) -> None:
        """The launcher is gone: continue the peers, stop as on SIGTERM, and be gone
        within the grace time."""
        self.orphaned = True
        for pid in self._peer_pids():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)
        with contextlib.suppress(OSError):
            os.kill(os.getpid(), signal.SIGTERM)
        threading.Thread(target=self._last_resort, name="lab2-rank-exit", daemon=True).start()

    def _last_resort(self) -> None:
        time.sleep(ORPHAN_GRACE_S)
        self._remove_folder()
        os._exit(EXIT_TERMINATED)

    def _remove_folder(self) -> None:
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)

    def stop(self, *, signalled: bool = False) -> None:
        """On the rank's way out: stop beating; clean up after a launcher that is gone.

        Args:
            signalled: the rank is stopping on SIGTERM or Ctrl-C. That may be the parent-
                death signal of a launcher killed with SIGKILL, which arrives as soon as
                the thread that started this rank exits, while the launcher's other
                threads still end: its pid stays this rank's parent for a moment. The
                rank waits up to a second to tell.
        """
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * HEARTBEAT_INTERVAL_S)
        deadline = time.monotonic() + (1.0 if signalled and self.folder else 0.0)
        while not self._launcher_gone() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._launcher_gone():
            self.orphaned = True
            self._remove_folder()

    def _launcher_gone(self) -> bool:
        if self.orphaned or os.getppid() != self.parent_pid:
            return True
        try:  # a launcher whose threads are all gone, not reaped yet
            with open(f"/proc/{self.parent_pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except (OSError, IndexError):
            return False


# ------------------------------------------------------------------------ launcher side
@dataclass
class RankEnd:
    """How a rank ended: ``code`` (its exit code) or ``signal`` (what killed it), and when
    (``time.monotonic()``)."""

    code: int | None
    signal: int | None
    at: float

    @property
    def failed(self) -> bool:
        return self.signal is not None or self.code not in (0, None)


def _peek_exit(pid: int, pidfd: int | None, now: float) -> RankEnd | None:
    """The end of a child that has exited, read without reaping it; None while it runs
    (or when it was reaped already)."""
    flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
    try:
        if pidfd is not None:
            info = os.waitid(os.P_PIDFD, pidfd, flags)
        else:
            info = os.waitid(os.P_PID, pid, flags)
    except (ChildProcessError, OSError):
        return None
    if info is None:
        return None
    if info.si_code == os.CLD_EXITED:
        return RankEnd(info.si_status, None, now)
    if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        return RankEnd(None, info.si_status, now)
    return None  # stopped or continued: not an end


class LaunchWatch:
    """The launcher's side, a thread: learns the ranks' pids, reads every rank's end as it
    happens, and kills (and names) a live rank without a heartbeat for ``timeout_s``.

    Args:
        folder: the watch folder the ranks write to.
        nproc: number of ranks.
        timeout_s: how long a rank may go without a heartbeat (``--timeout``).
    """

    def __init__(self, folder: str, nproc: int, timeout_s: float) -> None:
        self.folder, self.nproc, self.timeout_s = folder, nproc, timeout_s
        self.pids: dict[int, int] = {}
        self.ends: dict[int, RankEnd] = {}
        self.last_beat: dict[int, float] = {}
        self.frozen: dict[int, float] = {}  # rank: its silence when it was killed
        self._fds: dict[int, int | None] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="lab2-launch-watch", daemon=True)

    def start(self) -> LaunchWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for fd in self._fds.values():
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fds.clear()

    def status(self, rank: int) -> str | None:
        """What ``rank`` wrote about its failure (None: nothing)."""
        return _read(_status_file(self.folder, rank))

    def _learn_pids(self) -> None:
        for rank in range(self.nproc):
            if rank in self.pids:
                continue
            text = _read(_pid_file(self.folder, rank))
            if not text or not text.isdigit():
                continue
            pid = int(text)
            self.pids[rank] = pid
            fd = None
            with contextlib.suppress(OSError, AttributeError):
                fd = os.pidfd_open(pid)
            self._fds[rank] = fd

    def _beats(self) -> dict[int, float]:
        """Seconds since each live rank's last heartbeat."""
        now_wall, now = time.time(), time.monotonic()
        quiet = {}
        for rank in self.pids:
            if rank in self.ends:
                continue
            try:
                mtime = os.stat(_beat_file(self.folder, rank)).st_mtime
            except OSError:
                continue
            silence = max(0.0, now_wall - mtime)
            self.last_beat[rank] = now - silence
            quiet[rank] = silence
        return quiet

    def _poll_ends(self, wait: float) -> None:
        fds = [fd for r, fd in self._fds.items() if fd is not None and r not in self.ends]
        if fds:
            with contextlib.suppress(OSError, ValueError):
                select.select(fds, [], [], wait)
        else:
            self._stop.wait(wait)
        now = time.monotonic()  # one time for the ends seen together
        for rank, pid in self.pids.items():
            if rank not in self.ends:
                end = _peek_exit(pid, self._fds.get(rank), now)
                if end is not None:
                    self.ends[rank] = end

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                self._learn_pids()
                self._poll_ends(0.05)
                for rank, silence in self._beats().items():
                    if silence > self.timeout_s and rank not in self.frozen:
                        self.frozen[rank] = silence
                        with contextlib.suppress(OSError):
                            os.kill(self.pids[rank], signal.SIGKILL)

    def verdict(self, failures: dict[int, Any] | None = None) -> tuple[list[str], int]:
        """After the run failed: the lines that say which rank ended it and how, and the
        run's exit code.

        Args:
            failures: the elastic agent's record (global rank: ``ProcessFailure``), used
                for a rank whose end this watch did not see.
        """
        with self._lock:
            self._poll_ends(0.0)
            # The agent records the rank(s) it found failed before it stopped the others. One
            # whose end this watch missed (the agent reaped it first) failed before every
            # failure the watch saw, the others' SIGTERM among them: it goes first. (A clean
            # exit the watch saw says nothing of that order, and must not move it.)
            before_seen = min((e.at for e in self.ends.values() if e.failed),
                              default=time.monotonic())
            for rank, failure in (failures or {}).items():
                if rank not in self.ends and isinstance(getattr(failure, "exitcode", None), int):
                    code = failure.exitcode
                    self.ends[rank] = RankEnd(code if code >= 0 else None,
                                              -code if code < 0 else None, before_seen - 1e-3)
                    self.pids.setdefault(rank, getattr(failure, "pid", -1))
        pid = self.pids.get
        if self.frozen:
            names = ", ".join(f"rank {r} (pid {pid(r)})" for r in sorted(self.frozen))
            quiet = max(self.frozen.values())
            return [f"{names} stopped answering: no heartbeat for {quiet:.0f} s (--timeout "
                    f"{self.timeout_s:g}); stopped or frozen. Ending the run."], 1
        failed = {r: e for r, e in self.ends.items() if e.failed}
        first = min((e.at for e in failed.values()), default=time.monotonic())
        lines: list[Any] = []
        killed: dict[int, list[int]] = {}  # signal: the ranks it killed, one line each
        for rank in sorted(self.ends):
            end = self.ends[rank]
            if end.signal is not None:
                if end.signal not in killed:
                    lines.append(end.signal)  # placeholder, written below
                killed.setdefault(end.signal, []).append(rank)
            elif end.code in (EXIT_TERMINATED, EXIT_INTERRUPTED) and end.at <= first:
                # a signal to this rank alone, before anything else failed: it stopped in order
                lines.append(f"rank {rank} (pid {pid(rank)}) was stopped by "
                             f"{'SIGTERM' if end.code == EXIT_TERMINATED else 'SIGINT'}")
        lines = [line if isinstance(line, str) else killed_line(
            [(r, pid(r)) for r in killed[line]], line) for line in lines]
        why = self._why(first)
        if why:
            lines.append(why)
        # The run's code: a rank's own failure, not that of a rank the agent stopped after it.
        positive = [e.code for _, e in sorted(self.ends.items()) if e.code and not (
            e.code in (EXIT_TERMINATED, EXIT_INTERRUPTED) and e.at > first)]
        return lines, (positive[0] if positive else 1)

    def _why(self, first: float) -> str | None:
        """The rank(s) that stopped answering, when that is why the run failed."""
        pid = self.pids.get
        stale = max(4 * HEARTBEAT_INTERVAL_S + 0.5, min(self.timeout_s / 2, 10.0))
        silent = []
        for rank, beat in self.last_beat.items():
            end = self.ends.get(rank)
            if (end is None or end.at > first) and first - beat > stale:
                silent.append((rank, first - beat))
        if silent:
            names = ", ".join(f"rank {r} (pid {pid(r)}, no heartbeat for {q:.0f} s)"
                              for r, q in silent)
            return f"{names} stopped answering: stopped or frozen"
        timed_out = [r for r in range(self.nproc) if self.status(r) == TIMED_OUT]
        if not timed_out:
            return None
        waiting = ", ".join(map(str, timed_out))
        others = [r for r in range(self.nproc) if r not in timed_out and self.status(r) is None
                  and (r not in self.ends or not self.ends[r].failed or self.ends[r].at > first)]
        if others:
            names = ", ".join(f"rank {r} (pid {pid(r)})" for r in others)
            return (f"{names} stopped answering: rank(s) {waiting} gave up waiting for it in "
                    f"a collective after --timeout {self.timeout_s:g} s (it is alive but "
                    "stuck elsewhere)")
        return (f"rank(s) {waiting} timed out after --timeout {self.timeout_s:g} s waiting "
                "for each other in a collective")
