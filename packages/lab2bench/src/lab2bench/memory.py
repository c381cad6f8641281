"""Memory of a region: peak bytes and the CUDA allocator's snapshot.

On CUDA the figures come from the caching allocator (bytes held by tensors, not
what ``nvidia-smi`` shows). On the CPU there is no allocator to ask, so the peak
is the process's resident set, sampled by a background thread: it includes the
interpreter and every library, so compare differences, not absolute values.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lab2bench.devices import resolve_device, synchronize
from lab2bench.records import atomic_write_bytes, atomic_write_text


@dataclass
class PeakMemory:
    """Filled in by ``peak_memory`` when its block exits.

    Attributes:
        device: the device measured.
        start_bytes: allocated (CUDA) or resident (CPU) bytes when the block began.
        end_bytes: the same when it ended.
        peak_bytes: the highest value seen during the block (at least start and end).
        source: how it was measured: ``"cuda-allocator"`` or ``"rss-sampled"``.
    """

    device: torch.device
    start_bytes: int = 0
    end_bytes: int = 0
    peak_bytes: int = 0
    source: str = ""

    @property
    def increase_bytes(self) -> int:
        """Peak above the starting level: what the block itself needed at most."""
        return max(0, self.peak_bytes - self.start_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {"device": str(self.device), "start_bytes": self.start_bytes,
                "end_bytes": self.end_bytes, "peak_bytes": self.peak_bytes,
                "increase_bytes": self.increase_bytes, "source": self.source}


class _RssSampler(threading.Thread):
    """Polls the resident set size until stopped and keeps the largest value."""

    def __init__(self, interval: float) -> None:
        super().__init__(name="lab2bench-rss-sampler", daemon=True)
        import psutil

        self._process = psutil.Process(os.getpid())
        self._interval = interval
        self._halt = threading.Event()
        self.peak = self.read()

    def read(self) -> int:
        return int(self._process.memory_info().rss)

    def run(self) -> None:
        while not self._halt.wait(self._interval):
            self.peak = max(self.peak, self.read())

    def stop(self) -> int:
        self._halt.set()
        self.join(timeout=5.0)
        self.peak = max(self.peak, self.read())
        return self.peak


@contextlib.contextmanager
def peak_memory(
    device: torch.device | str | None = None, *, interval: float = 0.001
) -> Iterator[PeakMemory]:
    """Measure the peak memory of the ``with`` block.

    Example::

        with lab2bench.peak_memory("cuda") as mem:
            loss = model(x).sum(); loss.backward()
        print(mem.peak_bytes / 2**30, "GiB")

    Args:
        device: the device whose memory is measured (default: CUDA if available).
        interval: seconds between samples of the resident set on the CPU.

    Yields:
        A ``PeakMemory`` whose fields are set when the block exits (also on error).
    """
    dev = resolve_device(device)
    result = PeakMemory(device=dev)
    if dev.type == "cuda":
        synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        result.start_bytes = int(torch.cuda.memory_allocated(dev))
        result.source = "cuda-allocator"
        try:
            yield result
        finally:
            synchronize(dev)
            result.end_bytes = int(torch.cuda.memory_allocated(dev))
            result.peak_bytes = int(torch.cuda.max_memory_allocated(dev))
        return
    if dev.type != "cpu":
        raise ValueError(f"peak_memory supports cuda and cpu devices, got {dev}")
    sampler = _RssSampler(interval)
    result.source = "rss-sampled"
    result.start_bytes = sampler.peak
    sampler.start()
    try:
        yield result
    finally:
        result.peak_bytes = sampler.stop()
        result.end_bytes = sampler.read()


@dataclass
class MemorySnapshot:
    """Paths written by ``memory_snapshot`` (None where nothing was written)."""

    pickle_path: Path | None = None
    html_path: Path | None = None
    note: str = ""


@contextlib.contextmanager
def memory_snapshot(
    path_prefix: str | os.PathLike[str], *, device: torch.device | str | None = None,
) -> Iterator[MemorySnapshot]:
    """Record the CUDA allocator's history during the block and save it.

    Writes ``<prefix>.pickle`` (load it at https://pytorch.org/memory_viz) and
    ``<prefix>.html``, a self-contained memory timeline. On a CPU device it warns
    and writes nothing: the CPU has no allocator history to record.

    Args:
        path_prefix: output path without extension; parent folders are created.
        device: the device (default: CUDA if available, else CPU).
    """
    dev = resolve_device(device)
    result = MemorySnapshot()
    if dev.type != "cuda":
        result.note = f"memory_snapshot needs a CUDA device, got {dev}: nothing written"
        warnings.warn(result.note, RuntimeWarning, stacklevel=3)
        yield result
        return
    prefix = Path(path_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        yield result
        synchronize(dev)
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    result.pickle_path = prefix.with_name(prefix.name + ".pickle")
    atomic_write_bytes(result.pickle_path, pickle.dumps(snapshot))
    try:
        from torch.cuda._memory_viz import trace_plot

        html = trace_plot(snapshot)
        result.html_path = prefix.with_name(prefix.name + ".html")
        atomic_write_text(result.html_path, html)
    except Exception as err:  # the viewer is a private module; the pickle is what matters
        result.note = f"HTML timeline not written: {type(err).__name__}: {err}"
        warnings.warn(result.note, RuntimeWarning, stacklevel=3)

