"""Spawn N local ranks for the model-level suites: lab2bench's launcher with this app's preload.

``lab2bench.ranks.spawn_ranks`` does the work (forkserver, ``file://`` rendezvous, deadlines,
results back through a queue); this module only names the modules the forkserver should
import once, so that each rank starts with the model and the parallel wrappers loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lab2bench.ranks import RankError, backend_for, ping, threads_per_rank
from lab2bench.ranks import spawn_ranks as _spawn_ranks

__all__ = ["PRELOAD", "RankError", "backend_for", "ping", "spawn_ranks", "threads_per_rank"]

#: Modules the forkserver imports before forking ranks (missing optional ones are skipped by
#: multiprocessing).
PRELOAD = ["torch.nn.parallel", "torch.distributed.optim", "lab2bench", "tritonnorm", "minddp",
           "zero1", "lab2_trainer.model", "lab2_trainer.bench.ddp", "lab2_trainer.bench.zero",
           "lab2_trainer.bench.stack"]


def spawn_ranks(fn: Callable[..., Any], world_size: int, spec: Any, *, device: str = "cpu",
                timeout: float = 600.0, pg_timeout: float | None = None,
                threads: int | None = None) -> list[Any]:
    """``lab2bench.ranks.spawn_ranks`` with this app's modules preloaded (same arguments)."""
    return _spawn_ranks(fn, world_size, spec, device=device, timeout=timeout,
                        pg_timeout=pg_timeout, threads=threads, preload=PRELOAD)
