"""``--profile-steps A:B``: a ``torch.profiler`` trace of training steps A to B.

:class:`StepProfiler` starts the profiler before step A, names every traced step on the
timeline (``train step N``, a ``record_function`` range), and after step B waits for the
device, stops and writes the trace as Chrome trace JSON (open it in ``chrome://tracing``
or https://ui.perfetto.dev), atomically, one file per rank: :func:`trace_name`. It traces
the host (CPU) and, on CUDA, the kernels; tensor shapes and Python stacks are left out to
keep the file small. A run that ends inside the range (interrupted, or resumed past A)
writes the steps it traced. The traced steps run a little slower than untraced ones, and
the summary's step time and MFU count them as they are.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch


def trace_name(first: int, last: int, rank: int) -> str:
    """The trace's file name in the run folder."""
    return f"profile_steps{first}-{last}_rank{rank}.json"


class StepProfiler:
    """Trace steps ``first`` to ``last`` (counted from 1) into ``folder``.

    Args:
        first, last: the steps, both included.
        folder: the run folder.
        rank: this rank (in the file name).
        device: the rank's device (CUDA kernels are traced on a GPU).
    """

    def __init__(self, first: int, last: int, folder: Path, rank: int,
                 device: torch.device) -> None:
        self.first, self.last = first, last
        self.path = Path(folder) / trace_name(first, last, rank)
        self.device = device
        self._profiler: torch.profiler.profile | None = None
        self.written: Path | None = None

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around training step ``step``: traced (and named) when it is in the range."""
        if not self.first <= step <= self.last or self.written is not None:
            yield
            return
        if self._profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.start()
        with torch.profiler.record_function(f"train step {step}"):
            yield

    def due(self, step: int) -> bool:
        """Whether the trace is to be written now, after step ``step``."""
        return self._profiler is not None and step >= self.last

    def wait_for_device(self) -> None:
        """Wait until the device has run the traced steps' work."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def finish(self) -> Path | None:
        """Stop tracing and write the trace (if any step was traced); returns its path."""
        if self._profiler is None:
            return self.written
        self.wait_for_device()
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            profiler.export_chrome_trace(str(partial))
            os.replace(partial, self.path)
        finally:
            partial.unlink(missing_ok=True)
        self.written = self.path
        return self.path
