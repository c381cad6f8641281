"""Work that rank 0 does alone (the end of a run: loss curve, sample, summary) while the
other ranks wait for it, in a wait that ``--timeout`` bounds only while rank 0 is silent.

A collective (a barrier) would bound rank 0's legitimate work by the collective timeout:
a long sample, or a slow disk, would end a healthy run, and blame rank 0 for it. Here rank
0 beats in the process group's store while it works (a counter, twice a second) and sets a
done key at the end. The other ranks poll the store: they go on once it is done, and give
up (a ``TimeoutError``, reported as a timeout) only when the beat has not moved for
``--timeout`` seconds. A rank 0 that dies or fails never sets the key; its launcher ends
the run and names it, as for any failed rank. Without a process group, or alone, the work
simply runs.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")

#: How often rank 0 beats while it works, and how often the others look (seconds).
BEAT_S, POLL_S = 0.5, 0.1
#: Key prefix in the store; each call has its own number (the same on every rank, which
#: make the same calls in the same order).
PREFIX = "lab2/rank0-alone"
_calls = itertools.count()


def _store() -> Any | None:
    """The default process group's store, where this torch exposes it."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:
        return None
    try:
        return getter()
    except (RuntimeError, ValueError):
        return None


def rank0_alone(ctx: Any, what: str, work: Callable[[], T], timeout_s: float) -> T | None:
    """Run ``work()`` on rank 0 while the other ranks wait for it; returns what it returned
    (None on the other ranks).

    Args:
        ctx: the rank's :class:`lab2_trainer.runtime.launch.DistContext`.
        what: the work, in words, for the message of a rank that gives up.
        work: what rank 0 does.
        timeout_s: how long the others wait for a beat (``--timeout``).

    Raises:
        TimeoutError: (not on rank 0) rank 0 stopped beating for ``timeout_s`` seconds.
    """
    if not ctx.distributed or ctx.world_size == 1:
        return work() if ctx.is_main else None
    store = _store()
    if store is None:  # an old torch without the accessor: the collective it replaces
        result = work() if ctx.is_main else None
        ctx.barrier()
        return result
    key = f"{PREFIX}/{next(_calls)}"
    if ctx.is_main:
        return _work_beating(store, key, work)
    _wait(store, key, what, timeout_s)
    return None


def _work_beating(store: Any, key: str, work: Callable[[], T]) -> T:
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(BEAT_S):
            with contextlib.suppress(Exception):  # the store gone: the launcher tells
                store.add(f"{key}/beat", 1)

    thread = threading.Thread(target=beat, name="lab2-rank0-beat", daemon=True)
    thread.start()
    try:
        result = work()
    finally:
        stop.set()
        thread.join()
    store.set(f"{key}/done", "1")
    return result


def _wait(store: Any, key: str, what: str, timeout_s: float) -> None:
    last, since = None, time.monotonic()
    while not store.check([f"{key}/done"]):
        beats = store.add(f"{key}/beat", 0)
        now = time.monotonic()
        if beats != last:
            last, since = beats, now
        elif now - since > timeout_s:
            raise TimeoutError(f"rank 0 made no progress {what} for --timeout {timeout_s:g} s "
                               "(timed out)")
        time.sleep(POLL_S)
