"""Spawn N local ranks, with a deadline, and collect their results: the launcher of the
benchmarks and of the Gloo tests' ``lab2_testing.dist`` (``lab2-train --nproc`` uses
torch.distributed's elastic agent instead, as ``torchrun`` does).

Each rank is a fresh process started from a forkserver that has imported torch once (so a
rank starts in well under a second); it joins a process group through a ``file://``
rendezvous in a new temporary folder (no ports to clash on a shared machine), runs
``fn(rank, world_size, spec)`` and puts its (picklable) result on a queue. A rank that
raises, dies or outlives the deadline fails the whole run with its traceback, and every
remaining rank is killed: a hung collective costs the deadline, never forever. Every rank
asks Linux for SIGTERM when its parent dies, so none outlives its launcher; the rendezvous
folder is always removed, and one that a hard kill left anyway (it names its launcher in
:data:`OWNER_NAME`) is swept by the next launch (:func:`sweep_stale_rendezvous`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from lab2sys.processes import (
    OWNER_NAME,
    set_parent_death_signal,
    sweep_stale_folders,
    threads_per_rank,
    write_owner,
)

#: Modules the forkserver always imports before forking ranks.
BASE_PRELOAD = ("torch", "torch.distributed", "lab2bench.ranks")
#: The ``kind`` of this launcher's owner records (:data:`OWNER_NAME` in every rendezvous
#: folder names the launcher that made it, so that a later launcher can tell a dead run's).
_OWNER_KIND = "lab2bench.ranks.RankGroup rendezvous"
__all__ = ["OWNER_NAME", "RankError", "RankGroup", "ping", "spawn_ranks",
           "sweep_stale_rendezvous", "threads_per_rank"]


class RankError(RuntimeError):
    """A rank raised, died or did not finish in time.

    Attributes:
        kind: "raised" (the rank reported an exception or exited non-zero on its own),
            "died" (it ended without a report) or "deadline".
        ranks: the ranks concerned (the first one for "raised" and "died").
        detail: the failing rank's report: its traceback, or ``rank R exited with code C``
            when it printed its own error and exited.
    """

    def __init__(self, message: str, kind: str = "raised", ranks: Sequence[int] = (),
                 detail: str = "") -> None:
        super().__init__(message)
        self.kind, self.ranks, self.detail = kind, tuple(ranks), detail

    @property
    def rank(self) -> int | None:
        return self.ranks[0] if self.ranks else None


def sweep_stale_rendezvous(root: str | None = None, prefixes: Sequence[str] = ("lab2",)
                           ) -> list[str]:
    """Remove the rendezvous folders in ``root`` (default: the temporary folder) whose names
    start with one of ``prefixes`` and whose :data:`OWNER_NAME` names a process of this
    host that has exited; a folder without that file is left. Returns the paths removed."""
    return sweep_stale_folders(prefixes, root, kind=_OWNER_KIND)


def _child(fn: Callable[..., Any], rank: int, world_size: int, device: str, backend: str,
           init_method: str, pg_timeout: float, threads: int, spec: Any, results: Any) -> None:
    set_parent_death_signal()  # die with the forkserver, which dies with the launcher
    code = 0
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        os.environ["LOCAL_RANK"] = str(rank)
        if device.startswith("cuda"):
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=pg_timeout))
        try:
            results.put((rank, True, fn(rank, world_size, spec)))
        except SystemExit as exc:  # the rank reported its own error and chose its exit code
            code = exc.code if isinstance(exc.code, int) else 1
            results.put((rank, True, None) if code == 0
                        else (rank, False, f"rank {rank} exited with code {code}"))
        except BaseException:  # reported before the group is torn down: the root cause first
            code = 1
            results.put((rank, False, traceback.format_exc()))
        finally:
            dist.destroy_process_group()
    except BaseException:  # setup failed
        code = 1
        results.put((rank, False, traceback.format_exc()))
    if code:
        # A failed rank ends here, without the interpreter's shutdown, where threads of the
        # torch and Gloo runtimes may still call into a half-torn-down Python; its report is
        # sent and its output written first.
        results.close()
        results.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class RankGroup:
    """``world_size`` local ranks running ``fn(rank, world_size, spec)``, as a context
    manager: entering starts them (after sweeping the rendezvous folders of launchers that
    died), :meth:`collect` gathers their results, leaving kills whatever is left, restores
    ``OMP_NUM_THREADS`` and removes the rendezvous folder.

    Args:
        fn: a module-level (importable) function; its result must be picklable.
        world_size: number of ranks, >= 1. On CUDA, rank r uses GPU ``r % device_count``.
        spec: one picklable argument passed to every rank.
        device: "cpu" or "cuda" (each rank then sets its own GPU).
        backend: the process group's backend (default: Gloo on the CPU, NCCL on CUDA).
        pg_timeout: the process group's collective timeout, in seconds.
        threads: torch intra-op threads per rank (default: cores // world_size, >= 1).
        preload: modules the forkserver imports once before forking (``fn``'s module and
            what it needs), on top of torch and torch.distributed.
        rdzv_prefix: name prefix of the temporary rendezvous folder.
    """

    def __init__(self, fn: Callable[..., Any], world_size: int, spec: Any = None, *,
                 device: str = "cpu", backend: str | None = None, pg_timeout: float = 600.0,
                 threads: int | None = None, preload: Sequence[str] = (),
                 rdzv_prefix: str = "lab2-rdzv-") -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        self.fn, self.world_size, self.spec, self.device = fn, world_size, spec, device
        self.backend = backend or ("nccl" if device.startswith("cuda") else "gloo")
        self.pg_timeout = pg_timeout
        self.threads = threads or threads_per_rank(world_size)
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload([*BASE_PRELOAD, *preload])
        self.rdzv_prefix = rdzv_prefix
        self.procs: list[Any] = []
        self.tmp: str | None = None
        self._results: Any = None
        self._saved_threads: str | None = None

    def __enter__(self) -> RankGroup:
        self._results = self.ctx.Queue()
        sweep_stale_rendezvous(prefixes=("lab2", self.rdzv_prefix))
        self.tmp = tempfile.mkdtemp(prefix=self.rdzv_prefix)
        write_owner(self.tmp, kind=_OWNER_KIND)
        init_method = f"file://{os.path.join(self.tmp, 'rendezvous')}"
        # Ranks inherit the environment: OpenMP must not start a thread per core in each.
        self._saved_threads = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(self.threads)
        try:
            for rank in range(self.world_size):
                p = self.ctx.Process(target=_child, daemon=True, args=(
                    self.fn, rank, self.world_size, self.device, self.backend, init_method,
                    self.pg_timeout, self.threads, self.spec, self._results))
                p.start()
                self.procs.append(p)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        if self._saved_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = self._saved_threads
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def collect(self, timeout: float | None = None) -> list[Any]:
        """Wait for every rank's result (at most ``timeout`` seconds in all, None: no
        deadline); return them by rank.

        Raises:
            RankError: the first rank that raised or died, or the ranks still running at
                the deadline.
        """
        got: dict[int, Any] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(got) < self.world_size:
            wait = 0.5
            if deadline is not None:
                if (remaining := deadline - time.monotonic()) <= 0:
                    missing = sorted(set(range(self.world_size)) - set(got))
                    raise RankError(f"ranks {missing} did not finish within {timeout:.0f}s",
                                    "deadline", missing)
                wait = min(remaining, wait)
            try:
                rank, ok, data = self._results.get(timeout=wait)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs)
                        if r not in got and not p.is_alive() and p.exitcode not in (0, None)]
                if not dead:
                    continue
                try:  # its traceback may still be on the way
                    rank, ok, data = self._results.get(timeout=2.0)
                except queue.Empty:
                    raise RankError(f"rank {dead[0]} died with exit code "
                                    f"{self.procs[dead[0]].exitcode}", "died", dead) from None
            if not ok:
                raise RankError(f"rank {rank} of {self.world_size} raised:\n{data}"
                                + self._later_failures(), "raised", [rank], str(data))
            got[rank] = data
        for p in self.procs:  # they tear their process group down and exit
            p.join(timeout=60.0 if deadline is None else max(1.0, deadline - time.monotonic()))
        return [got[r] for r in range(self.world_size)]

    def _later_failures(self, grace: float = 1.0) -> str:
        """Errors other ranks report within ``grace`` seconds of the first (usually its
        consequences, such as a peer's closed connection), by their last line."""
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
    """Run ``fn(rank, world_size, spec)`` on ``world_size`` local ranks (a
    :class:`RankGroup`) within ``timeout`` seconds; return the results by rank.
    ``pg_timeout`` defaults to ``timeout``.

    Raises:
        ValueError: ``world_size`` < 1, or more CUDA ranks than GPUs.
        RankError: a rank raised, died or ran past ``timeout``.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if device.startswith("cuda"):
        import torch

        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if world_size > visible:
            raise ValueError(f"world_size {world_size} needs one GPU per rank; {visible} visible")
    with RankGroup(fn, world_size, spec, device=device, backend=backend,
                   pg_timeout=pg_timeout or timeout, threads=threads, preload=preload,
                   rdzv_prefix="lab2-bench-rdzv-") as group:
        return group.collect(timeout)


def ping(rank: int, world_size: int, spec: dict[str, Any]) -> float:
    """A check of the launcher and backend: all-reduces ``rank + spec["offset"]`` and returns
    the sum; the rank named by ``spec["fail_rank"]`` raises instead (and the others then wait
    in a barrier that only the launcher's deadline or the error report ends)."""
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
