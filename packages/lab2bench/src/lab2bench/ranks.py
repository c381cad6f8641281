"""Spawn N local ranks, with deadlines, and collect their results: the launcher of the
benchmarks and of the Gloo tests' ``lab2_testing.dist`` (``lab2-train --nproc`` uses
torch.distributed's elastic agent instead, as ``torchrun`` does).

Each rank is a fresh process, by default started from a forkserver that has imported torch
once (so a rank starts in well under a second); it joins a process group through a
``file://`` rendezvous in a new temporary folder (no ports to clash on a shared machine),
runs ``fn(rank, world_size, spec)`` and puts its (picklable) result on a queue. A rank that
raises, dies, outlives the deadline or stops giving heartbeats fails the whole run with its
traceback, and every remaining rank is stopped: a hung collective costs the deadline, never
forever. Every rank dies with its launcher and takes SIGTERM like Ctrl-C
(:mod:`lab2bench.supervise`); the rendezvous folder is always removed, and one that a hard
kill left anyway (it names its launcher in :data:`OWNER_NAME`) is swept by the next
launch (:func:`sweep_stale_rendezvous`).

:class:`RankGroup` is the core (start, :meth:`RankGroup.collect`, stop and clean up on
exit); :func:`spawn_ranks` is the benchmarks' call. Used by ``lab2bench.comm`` and by
suites in other packages, which pass the modules their ranks need as ``preload``.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from lab2bench.records import atomic_write_text
from lab2bench.supervise import RankWatch, exit_code_for

#: How a rank that reported its own error and exited says so (``rank R exited with code C``).
EXITED = "exited with code"

#: Modules the forkserver always imports before forking ranks.
BASE_PRELOAD = ("torch", "torch.distributed", "lab2bench.ranks")

#: The file in every rendezvous folder that names the launcher which made it (pid, host,
#: the pid's start time), so that a later launcher can tell a dead run's folder.
OWNER_NAME = "owner.json"
_OWNER_KIND = "lab2bench.ranks.RankGroup rendezvous"


class RankError(RuntimeError):
    """A rank raised, died, did not finish in time or stopped answering.

    Attributes:
        kind: "raised" (the rank reported an exception or exited non-zero on its own),
            "died" (it ended without a report), "deadline" or "silent" (no heartbeat).
        ranks: the ranks concerned (the first one for "raised" and "died").
        detail: the failing rank's report: its traceback, or ``rank R exited with code C``
            when it printed its own error and exited.
    """

    def __init__(self, message: str, kind: str = "raised", ranks: Sequence[int] = (),
                 detail: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.ranks = tuple(ranks)
        self.detail = detail

    @property
    def rank(self) -> int | None:
        return self.ranks[0] if self.ranks else None


def backend_for(device: str) -> str:
    """Gloo for the CPU, NCCL for CUDA devices."""
    return "nccl" if device.startswith("cuda") else "gloo"


def threads_per_rank(world_size: int) -> int:
    """Intra-op threads each CPU rank should use so ranks do not oversubscribe the cores
    (on 2 cores with 2 ranks: 1 thread each)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, world_size))


def _process_start(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot; Linux), which tells a
    live owner from a later process that reuses its pid; None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _owner_record() -> str:
    pid = os.getpid()
    return json.dumps({"kind": _OWNER_KIND, "pid": pid, "host": socket.gethostname(),
                       "process_start": _process_start(pid)}) + "\n"


def _owner_gone(info: Any) -> bool:
    """Whether the launcher an owner record names is gone (on this host); False for
    anything else (another host's, or not such a record), which is left alone."""
    if not isinstance(info, dict) or info.get("kind") != _OWNER_KIND:
        return False
    pid = info.get("pid")
    if info.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive under another user, or cannot tell
        return False
    started, now = info.get("process_start"), _process_start(pid)
    return started is not None and now is not None and started != now


def sweep_stale_rendezvous(root: str | None = None, prefixes: Sequence[str] = ("lab2",)
                           ) -> list[str]:
    """Remove the rendezvous folders that launchers now gone left in ``root``.

    A launcher removes its folder on the way out, and its orphaned ranks do when it dies;
    what a hard kill leaves anyway (a rank stopped with SIGSTOP when its launcher was
    killed, say) is swept here, at the next start. Only folders whose names start with one
    of ``prefixes`` and whose :data:`OWNER_NAME` names a process of this host that has
    exited are removed: a folder without that file (being created, or not ours) is left.

    Args:
        root: where the folders are (default: ``tempfile.gettempdir()``).
        prefixes: the folder name prefixes to look at.

    Returns:
        The paths removed.
    """
    root = root or tempfile.gettempdir()
    removed = []
    try:
        entries = [e for e in os.scandir(root) if e.name.startswith(tuple(prefixes))]
    except OSError:
        return removed
    for entry in entries:
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
            with open(os.path.join(entry.path, OWNER_NAME), encoding="utf-8") as f:
                info = json.loads(f.read())
        except (OSError, ValueError):
            continue
        if _owner_gone(info):
            shutil.rmtree(entry.path, ignore_errors=True)
            if not os.path.exists(entry.path):
                removed.append(entry.path)
    return removed


_WATCH: RankWatch | None = None


def rank_watch() -> RankWatch | None:
    """In a rank started by :class:`RankGroup`: the launcher's :class:`RankWatch` (for
    :meth:`RankWatch.mark`); None elsewhere."""
    return _WATCH


def _child(fn: Callable[..., Any], rank: int, world_size: int, device: str, backend: str,
           init_method: str, pg_timeout: float, threads: int, spec: Any, results: Any,
           watch: RankWatch) -> None:
    global _WATCH
    # First of all: die with the launcher, beat, and take SIGTERM like Ctrl-C.
    _WATCH = watch
    guard = watch.start_rank(rank)
    code = 0
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        os.environ["LOCAL_RANK"] = str(rank)
        if device.startswith("cuda"):
            # One GPU per rank; the device machine's NCCL environment is inherited untouched.
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
        try:
            results.put((rank, True, fn(rank, world_size, spec)))
        except SystemExit as exc:
            # The rank reported its own error and chose its exit code.
            code = exc.code if isinstance(exc.code, int) else 1
            results.put((rank, True, None) if code == 0
                        else (rank, False, f"rank {rank} {EXITED} {code}"))
        except BaseException as exc:
            # Reported before the group is torn down: the peers' "connection closed" errors
            # then arrive after the root cause.
            code = exit_code_for(exc) if isinstance(exc, KeyboardInterrupt) else 1
            results.put((rank, False, traceback.format_exc()))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # setup failed; report everything, KeyboardInterrupt included
        code = exit_code_for(exc) if isinstance(exc, KeyboardInterrupt) else 1
        results.put((rank, False, traceback.format_exc()))
    finally:
        guard.stop()
    if code:
        # A failed or interrupted rank ends here without the interpreter's shutdown, where
        # threads of the torch and Gloo runtimes may still call into a half-torn-down
        # Python (seen as "write to closed file" aborts after Ctrl-C). Its report is sent
        # (the queue's feeder thread flushed) and its output written first.
        results.close()
        results.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class RankGroup:
    """``world_size`` local ranks running ``fn(rank, world_size, spec)``, as a context
    manager: entering starts them, :meth:`collect` gathers their results, leaving stops
    whatever is left (SIGKILL for :attr:`frozen` ranks, SIGTERM and then, after
    ``stop_grace`` seconds, SIGKILL for the others), restores ``OMP_NUM_THREADS`` and
    removes the rendezvous folder. Entering first sweeps the rendezvous folders of
    launchers that died (:func:`sweep_stale_rendezvous`); the new folder holds an
    :data:`OWNER_NAME` naming this process.

    Args:
        fn: a module-level (importable) function; its result must be picklable.
        world_size: number of ranks, >= 1. On CUDA, rank r uses GPU ``r % device_count``.
        spec: one picklable argument passed to every rank.
        device: "cpu" or "cuda" (each rank then sets its own GPU).
        backend: the process group's backend (default: Gloo on the CPU, NCCL on CUDA).
        pg_timeout: the process group's collective timeout, in seconds.
        threads: torch intra-op threads per rank (default: cores // world_size, >= 1).
        start_method: "forkserver" (default), "fork" or "spawn".
        preload: modules a forkserver imports once before forking (``fn``'s module and
            what it needs), on top of torch and torch.distributed.
        rdzv_prefix: name prefix of the temporary rendezvous folder.
        stop_grace: seconds ranks get to stop after SIGTERM before SIGKILL (0: kill).
        daemon: start the ranks as daemonic processes (they cannot have children).
        watch_type: the :class:`RankWatch` class to build (a subclass, say).

    Attributes:
        procs: the rank processes, by rank.
        watch: heartbeats and statuses shared with the ranks.
        frozen: ranks to SIGKILL at once on the way out.
    """

    def __init__(self, fn: Callable[..., Any], world_size: int, spec: Any = None, *,
                 device: str = "cpu", backend: str | None = None, pg_timeout: float = 600.0,
                 threads: int | None = None, start_method: str = "forkserver",
                 preload: Sequence[str] = (), rdzv_prefix: str = "lab2-rdzv-",
                 stop_grace: float = 0.0, daemon: bool = True,
                 watch_type: type[RankWatch] = RankWatch) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        self.fn, self.world_size, self.spec = fn, world_size, spec
        self.device = device
        self.backend = backend or backend_for(device)
        self.pg_timeout = pg_timeout
        self.threads = threads or threads_per_rank(world_size)
        self.ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            # The forkserver imports these once; every rank forked from it (and every later
            # launch from this process) starts with them loaded instead of paying seconds each.
            self.ctx.set_forkserver_preload([*BASE_PRELOAD, *preload])
        self.start_method = start_method
        self.rdzv_prefix = rdzv_prefix
        self.stop_grace = stop_grace
        self.daemon = daemon
        self._watch_type = watch_type
        self.procs: list[Any] = []
        self.frozen: tuple[int, ...] = ()
        self.tmp: str | None = None
        self.watch: RankWatch | None = None
        self._results: Any = None
        self._saved_threads: str | None = None

    def __enter__(self) -> RankGroup:
        self._results = self.ctx.Queue()
        sweep_stale_rendezvous(prefixes=("lab2", self.rdzv_prefix))
        self.tmp = tempfile.mkdtemp(prefix=self.rdzv_prefix)
        atomic_write_text(os.path.join(self.tmp, OWNER_NAME), _owner_record())
        init_method = f"file://{os.path.join(self.tmp, 'rendezvous')}"
        self.watch = self._watch_type(self.ctx, self.world_size, self.tmp,
                                      direct_children=self.start_method != "forkserver")
        # Ranks inherit the environment: OpenMP must not start a thread per core in each.
        self._saved_threads = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(self.threads)
        try:
            for rank in range(self.world_size):
                p = self.ctx.Process(
                    target=_child,
                    args=(self.fn, rank, self.world_size, self.device, self.backend,
                          init_method, self.pg_timeout, self.threads, self.spec,
                          self._results, self.watch),
                    daemon=self.daemon,
                )
                p.start()
                self.procs.append(p)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.stop()
        finally:
            if self._saved_threads is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = self._saved_threads
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)

    def stop(self) -> None:
        """SIGKILL for the ranks in :attr:`frozen` (they cannot stop in order, and their
        peers' collectives fail at once when they are gone); SIGTERM (the ranks' orderly
        stop) and SIGCONT for the others, or SIGKILL when ``stop_grace`` is 0; then SIGKILL
        for any left after ``stop_grace`` seconds."""
        for rank in self.frozen:
            self.procs[rank].kill()
        for p in self.procs:
            if p.is_alive():
                if self.stop_grace <= 0:
                    p.kill()
                    continue
                p.terminate()
                with contextlib.suppress(OSError):
                    os.kill(p.pid, signal.SIGCONT)
        deadline = time.monotonic() + max(self.stop_grace, 0.0)
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    def collect(self, timeout: float | None = None, *,
                silence_limit: float | None = None) -> list[Any]:
        """Wait for every rank's result; return them by rank.

        Args:
            timeout: seconds the ranks may take in all (None: no deadline).
            silence_limit: a live rank without a heartbeat for this long ends the run
                (None: heartbeats are not checked).

        Raises:
            RankError: the first rank that raised or died, the ranks still running at the
                deadline, or the ranks that stopped answering (then also :attr:`frozen`).
        """
        world_size, procs = self.world_size, self.procs
        got: dict[int, Any] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(got) < world_size:
            wait = 0.5
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(world_size)) - set(got))
                    raise RankError(f"ranks {missing} did not finish within {timeout:.0f}s",
                                    "deadline", missing)
                wait = min(remaining, wait)
            if silence_limit is not None:
                silent = self.watch.silent_ranks(procs, silence_limit)
                if silent:
                    self.frozen = tuple(r for r, _ in silent)
                    names = ", ".join(f"rank {r} (pid {procs[r].pid})" for r, _ in silent)
                    raise RankError(
                        f"{names} stopped answering: no heartbeat for "
                        f"{max(q for _, q in silent):.0f} s", "silent", self.frozen)
            try:
                rank, ok, data = self._results.get(timeout=wait)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if r not in got and not p.is_alive() and p.exitcode not in (0, None)]
                if not dead:
                    continue
                try:  # its traceback may still be on the way
                    rank, ok, data = self._results.get(timeout=2.0)
                except queue.Empty:
                    raise RankError(
                        f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}",
                        "died", dead) from None
            if not ok:
                raise RankError(f"rank {rank} of {world_size} raised:\n{data}"
                                + self._later_failures(), "raised", [rank], str(data))
            got[rank] = data
        for p in procs:  # they tear their process group down and exit
            p.join(timeout=60.0 if deadline is None
                   else max(1.0, deadline - time.monotonic()))
        return [got[r] for r in range(world_size)]

    def _later_failures(self, grace: float = 1.0) -> str:
        """Errors other ranks report within ``grace`` seconds of the first (usually
        consequences of it, such as a peer's closed connection), summarised by their last
        line."""
        lines = []
        deadline = time.monotonic() + grace
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                rank, ok, data = self._results.get(timeout=remaining)
            except queue.Empty:
                break
            if not ok:
                last = str(data).strip().splitlines()[-1:] or [""]
                lines.append(f"\n(then rank {rank}: {last[0]})")
        return "".join(lines)


def spawn_ranks(fn: Callable[..., Any], world_size: int, spec: Any, *, device: str = "cpu",
                backend: str | None = None, timeout: float = 600.0,
                pg_timeout: float | None = None, threads: int | None = None,
                preload: Sequence[str] = ()) -> list[Any]:
    """Run ``fn(rank, world_size, spec)`` on ``world_size`` local ranks; return results by rank.

    Args:
        fn: a module-level (importable) function; its result must be picklable.
        world_size: number of ranks, >= 1. On CUDA, rank r uses GPU ``r % device_count``.
        spec: one picklable argument passed to every rank (the suite's settings).
        device: "cpu" or "cuda" (each rank then sets its own GPU).
        backend: the process group's backend (default: Gloo on the CPU, NCCL on CUDA).
        timeout: seconds the whole run may take before every rank is killed.
        pg_timeout: the process group's collective timeout (default: ``timeout``).
        threads: torch intra-op threads per rank (default: cores // world_size, >= 1).
        preload: modules the forkserver imports once before forking (``fn``'s module and
            what it needs), on top of torch and torch.distributed.

    Raises:
        ValueError: ``world_size`` < 1, or more CUDA ranks than GPUs.
        RankError: a rank raised, died or ran past ``timeout``.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but CUDA is not available")
        if world_size > torch.cuda.device_count():
            raise ValueError(
                f"world_size {world_size} needs one GPU per rank; "
                f"{torch.cuda.device_count()} visible"
            )
    with RankGroup(fn, world_size, spec, device=device, backend=backend,
                   pg_timeout=pg_timeout or timeout, threads=threads, preload=preload,
                   rdzv_prefix="lab2-bench-rdzv-") as group:
        return group.collect(timeout)


def ping(rank: int, world_size: int, spec: dict[str, Any]) -> float:
    """A check of the launcher and backend: all-reduces ``rank + spec["offset"]`` and returns
    the sum; the rank named by ``spec["fail_rank"]`` raises instead (and the others then wait
    in a barrier that only the launcher's deadline or the error report ends).

    Args:
        rank: this rank.
        world_size: number of ranks.
        spec: ``{"offset": float, "fail_rank": int | None}``.
    """
    import torch
    import torch.distributed as dist

    if spec.get("fail_rank") == rank:
        raise RuntimeError(f"ping: rank {rank} fails on purpose")
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([float(rank + spec.get("offset", 0.0))], device=device)
    dist.all_reduce(t)
    if spec.get("fail_rank") is not None:
        dist.barrier()
    return float(t.item())
