"""lab2bench: benchmarking for PyTorch code.

Timing (``measure``, ``Stats``), memory (``peak_memory``, ``memory_snapshot``), bandwidth
(``copy_bandwidth``), all-reduce sweeps (``lab2bench.comm.allreduce_sweep``), a launcher
of local ranks for distributed benchmarks (``spawn_ranks``) and
reporting (``Recorder``, ``read_records``, ``markdown_table``, ``plot_sweep``,
``progress``, ``env_info``). The ``lab2bench comm`` command runs the all-reduce sweep.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.8.0"

# Every name is imported on first use (PEP 562), so that `import lab2bench` and the
# `lab2bench --help` it serves do not import torch.
_EXPORTS = {
    "comm": None,
    "copy_bandwidth": "bandwidth",
    "resolve_device": "devices", "synchronize": "devices",
    "env_info": "env", "git_commit": "env",
    "MemorySnapshot": "memory", "PeakMemory": "memory", "memory_snapshot": "memory",
    "peak_memory": "memory",
    "RankError": "ranks", "spawn_ranks": "ranks",
    "Recorder": "records", "atomic_write": "records", "atomic_write_bytes": "records",
    "atomic_write_text": "records",
    "read_records": "records",
    "markdown_table": "report", "plot_sweep": "report", "progress": "report",
    "Stats": "timing", "measure": "timing",
}

if TYPE_CHECKING:
    from lab2bench import comm
    from lab2bench.bandwidth import copy_bandwidth
    from lab2bench.devices import resolve_device, synchronize
    from lab2bench.env import env_info, git_commit
    from lab2bench.memory import MemorySnapshot, PeakMemory, memory_snapshot, peak_memory
    from lab2bench.ranks import RankError, spawn_ranks
    from lab2bench.records import (
        Recorder,
        atomic_write,
        atomic_write_bytes,
        atomic_write_text,
        read_records,
    )
    from lab2bench.report import markdown_table, plot_sweep, progress
    from lab2bench.timing import Stats, measure


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lab2bench' has no attribute {name!r}")
    module = _EXPORTS[name]
    if module is None:
        return importlib.import_module(f"lab2bench.{name}")
    value = getattr(importlib.import_module(f"lab2bench.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = [
    "MemorySnapshot",
    "PeakMemory",
    "RankError",
    "Recorder",
    "Stats",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_text",
    "comm",
    "copy_bandwidth",
    "env_info",
    "git_commit",
    "markdown_table",
    "measure",
    "memory_snapshot",
    "peak_memory",
    "plot_sweep",
    "progress",
    "read_records",
    "resolve_device",
    "spawn_ranks",
    "synchronize",
]
