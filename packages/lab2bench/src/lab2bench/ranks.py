"""Spawn N local ranks for a distributed benchmark, with deadlines, and collect their results.

Each rank is a fresh process started from a forkserver that has imported torch once (so a
rank starts in well under a second), joins a process group through a ``file://`` rendezvous
in a new temporary folder (no ports to clash on a shared machine), runs
``fn(rank, world_size, spec)`` and puts its (picklable) result on a queue. A rank that
raises, dies or outlives the deadline fails the whole run with its traceback, and every
remaining rank is killed: a hung collective costs the deadline, never forever.

Used by ``lab2bench.comm`` and by suites in other packages (the trainer's model-level
suites), which pass the modules their ranks need as ``preload``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

#: Modules the forkserver always imports before forking ranks.
BASE_PRELOAD = ("torch", "torch.distributed", "lab2bench.ranks")


class RankError(RuntimeError):
    """A benchmark rank raised, died or did not finish in time."""


def backend_for(device: str) -> str:
    """Gloo for the CPU, NCCL for CUDA devices."""
    return "nccl" if device.startswith("cuda") else "gloo"


def threads_per_rank(world_size: int) -> int:
    """Intra-op threads each CPU rank should use so ranks do not oversubscribe the cores
    (on 2 cores with 2 ranks: 1 thread each)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, world_size))


def _child(fn: Callable[..., Any], rank: int, world_size: int, device: str, backend: str,
           init_file: str, pg_timeout: float, threads: int, spec: Any, results: Any) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        if device.startswith("cuda"):
            # One GPU per rank; the device machine's NCCL environment is inherited untouched.
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
        try:
            results.put((rank, True, fn(rank, world_size, spec)))
        except BaseException:
            # Reported before the group is torn down: the peers' "connection closed" errors
            # then arrive after the root cause.
            results.put((rank, False, traceback.format_exc()))
        finally:
            dist.destroy_process_group()
    except BaseException:  # setup failed; report everything, KeyboardInterrupt included
        results.put((rank, False, traceback.format_exc()))


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
    backend = backend or backend_for(device)
    threads = threads or threads_per_rank(world_size)
    ctx = mp.get_context("forkserver")
    # The forkserver imports these once; every rank forked from it (and every later launch
    # from this process) starts with them loaded instead of paying seconds each.
    ctx.set_forkserver_preload([*BASE_PRELOAD, *preload])
    results = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="lab2-bench-rdzv-")
    init_file = os.path.join(tmp, "rendezvous")
    # Ranks inherit the environment: OpenMP must not start a thread per core in each.
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    procs = []
    try:
        for rank in range(world_size):
            p = ctx.Process(
                target=_child,
                args=(fn, rank, world_size, device, backend, init_file, pg_timeout or timeout,
                      threads, spec, results),
                daemon=True,
            )
            p.start()
            procs.append(p)
        return _collect(procs, results, world_size, timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
        shutil.rmtree(tmp, ignore_errors=True)


def _collect(procs: list[Any], results: Any, world_size: int, timeout: float) -> list[Any]:
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(got) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(world_size)) - set(got))
            raise RankError(f"ranks {missing} did not finish within {timeout:.0f}s")
        try:
            rank, ok, data = results.get(timeout=min(remaining, 0.5))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs)
                    if r not in got and not p.is_alive() and p.exitcode not in (0, None)]
            if not dead:
                continue
            try:  # its traceback may still be on the way
                rank, ok, data = results.get(timeout=2.0)
            except queue.Empty:
                raise RankError(
                    f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}"
                ) from None
        if not ok:
            raise RankError(f"rank {rank} of {world_size} raised:\n{data}"
                            + _later_failures(results))
        got[rank] = data
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
    return [got[r] for r in range(world_size)]


def _later_failures(results: Any, grace: float = 1.0) -> str:
    """Errors other ranks report within ``grace`` seconds of the first (usually consequences
    of it, such as a peer's closed connection), summarised by their last line."""
    lines = []
    deadline = time.monotonic() + grace
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            rank, ok, data = results.get(timeout=remaining)
        except queue.Empty:
            break
        if not ok:
            last = str(data).strip().splitlines()[-1:] or [""]
            lines.append(f"\n(then rank {rank}: {last[0]})")
    return "".join(lines)


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
