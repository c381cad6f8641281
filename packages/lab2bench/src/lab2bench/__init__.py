"""lab2bench: benchmarking and profiling for PyTorch code.

Timing (``measure``, ``Stats``), profiling (``profile``, ``label``), memory
(``peak_memory``, ``memory_snapshot``, ``tensor_bytes``), bandwidth
(``copy_bandwidth``), all-reduce sweeps (``lab2bench.comm.allreduce_sweep``), a launcher
of local ranks for distributed benchmarks (``spawn_ranks``) and
reporting (``Recorder``, ``read_records``, ``markdown_table``, ``plot_sweep``,
``progress``, ``env_info``). The ``lab2bench`` command runs the benchmark suites.
"""

from lab2bench import comm
from lab2bench.bandwidth import copy_bandwidth, copy_bandwidth_stats
from lab2bench.devices import resolve_device, synchronize
from lab2bench.env import env_info, git_commit
from lab2bench.memory import MemorySnapshot, PeakMemory, memory_snapshot, peak_memory, tensor_bytes
from lab2bench.profiling import ProfileResult, label, profile
from lab2bench.ranks import RankError, spawn_ranks
from lab2bench.records import (
    Recorder,
    atomic_write_bytes,
    atomic_write_text,
    read_records,
    write_jsonl,
)
from lab2bench.report import markdown_table, plot_sweep, progress
from lab2bench.suites import Suite, register_suite
from lab2bench.timing import Stats, measure

__version__ = "0.2.0"

__all__ = [
    "MemorySnapshot",
    "PeakMemory",
    "ProfileResult",
    "RankError",
    "Recorder",
    "Stats",
    "Suite",
    "atomic_write_bytes",
    "atomic_write_text",
    "comm",
    "copy_bandwidth",
    "copy_bandwidth_stats",
    "env_info",
    "git_commit",
    "label",
    "markdown_table",
    "measure",
    "memory_snapshot",
    "peak_memory",
    "plot_sweep",
    "profile",
    "progress",
    "read_records",
    "register_suite",
    "resolve_device",
    "spawn_ranks",
    "synchronize",
    "tensor_bytes",
    "write_jsonl",
]
