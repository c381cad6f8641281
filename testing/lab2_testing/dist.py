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
``torch.save`` bytes, so tensors are fine. The launching is
:class:`lab2bench.ranks.RankGroup`'s, the workspace's one rank launcher.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lab2_testing.modules import load_path
from lab2bench.ranks import RankError, RankGroup


class RankFailed(RankError):
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


def _call_by_path(rank: int, world_size: int, spec: tuple[str, str, bytes]) -> bytes:
    path, name, payload = spec
    fn = _load_function(path, name)
    return _dumps(fn(rank, world_size, *_loads(payload)))


# A forkserver that has imported torch once: each rank starts in milliseconds instead of
# importing torch again (seconds on a small CI machine). ``torch._dynamo`` is preloaded
# too: recent torch imports it the first time an optimizer is built, which costs 20-40 s
# per rank on a loaded 2-core machine.
PRELOAD = ("torch._dynamo", "lab2_testing.dist")


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
    spec = (fn.__code__.co_filename, fn.__name__, _dumps(args))
    try:
        with RankGroup(_call_by_path, world_size, spec, backend="gloo",
                       pg_timeout=pg_timeout or timeout, threads=1, preload=PRELOAD,
                       rdzv_prefix="lab2-rdzv-") as group:
            return [_loads(data) for data in group.collect(timeout)]
    except RankFailed:
        raise
    except RankError as exc:
        raise RankFailed(str(exc), exc.kind, exc.ranks, exc.detail) from None


def runs_per_world_size(fn: Callable[..., Any], *args: Any, root: Path,
                        timeout: float) -> Callable[[int], list[Any]]:
    """``run(world_size)``: :func:`run_ranks` of ``fn(rank, world_size, *args, folder)``,
    ``folder`` being ``root / "ws<world_size>"`` (as a string), run once per world size and
    remembered, for a module's tests that each read their part of one run. ``run.root`` is
    ``root``."""

    @functools.cache
    def run(world_size: int) -> list[Any]:
        return run_ranks(fn, world_size, *args, str(root / f"ws{world_size}"),
                         timeout=timeout)

    run.root = root  # type: ignore[attr-defined]
    return run
