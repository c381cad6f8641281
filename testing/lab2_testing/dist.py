"""Run a function on N local ranks over Gloo, with a deadline.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` fresh processes, joins
them into a Gloo process group through a new ``file://`` rendezvous (no ports),
calls ``fn(rank, world_size, *args)`` on each and returns the per-rank results in
rank order. A rank that raises, dies or outlives ``timeout`` seconds fails the
whole call within that time, with the rank's traceback in the message, and every
rank left is killed: a hang costs seconds, not the CI budget.

``fn`` must be a module-level function. It is found again in the children by the
file it is defined in, which also works for pytest's ``importlib`` import mode,
where test modules are not importable by name. Arguments and results travel as
``torch.save`` bytes, so tensors are fine.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from lab2_testing.modules import load_path


class RankFailed(RuntimeError):
    """A rank raised, died or did not finish in time."""


def _dumps(obj: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _load_function(path: str, name: str) -> Callable[..., Any]:
    return getattr(load_path(path, f"_lab2_rank_module_{abs(hash(path))}"), name)


def _child(rank: int, world_size: int, init_file: str, pg_timeout: float, path: str,
           name: str, payload: bytes, results: Any) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
        try:
            fn = _load_function(path, name)
            out = fn(rank, world_size, *_loads(payload))
            results.put((rank, True, _dumps(out)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report everything, KeyboardInterrupt included
        results.put((rank, False, traceback.format_exc()))


def _context() -> Any:
    """A forkserver that has imported torch once: each rank starts in milliseconds
    instead of importing torch again (seconds on a small CI machine).

    ``torch._dynamo`` is preloaded too: recent torch imports it the first time an
    optimizer is built, which costs 20-40 s per rank on a loaded 2-core machine.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "lab2_testing.dist"])
    return ctx


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
              pg_timeout: float | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` Gloo ranks; return results by rank.

    Args:
        fn: a module-level function.
        world_size: number of processes, at least 1.
        *args: passed to ``fn`` on every rank (through ``torch.save``).
        timeout: seconds the whole run may take before every rank is killed.
        pg_timeout: the process group's own collective timeout (default: ``timeout``).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    path = fn.__code__.co_filename
    ctx = _context()
    results = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="lab2-rdzv-")
    init_file = os.path.join(tmp, "rendezvous")
    payload = _dumps(args)
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    procs = []
    try:
        for rank in range(world_size):
            p = ctx.Process(
                target=_child,
                args=(rank, world_size, init_file, pg_timeout or timeout, path, fn.__name__,
                      payload, results),
                daemon=True,
            )
            p.start()
            procs.append(p)
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(got) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(got))
                raise RankFailed(f"ranks {missing} did not finish within {timeout:.0f}s")
            try:
                rank, ok, data = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if r not in got and not p.is_alive() and p.exitcode not in (0, None)]
                if dead:
                    # Give its message a moment to arrive before blaming the exit code.
                    try:
                        rank, ok, data = results.get(timeout=2.0)
                    except queue.Empty:
                        raise RankFailed(
                            f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}"
                        ) from None
                else:
                    continue
            if not ok:
                raise RankFailed(f"rank {rank} of {world_size} raised:\n{data}")
            got[rank] = _loads(data)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        return [got[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_threads
        shutil.rmtree(tmp, ignore_errors=True)
