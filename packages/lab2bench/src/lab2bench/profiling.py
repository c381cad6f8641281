"""A ``torch.profiler`` session that leaves a table, a Chrome trace and flame-graph stacks."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity

from lab2bench.devices import resolve_device, synchronize
from lab2bench.records import atomic_write_text, temp_file_beside


@dataclass
class ProfileResult:
    """What ``profile`` wrote, filled in when its block exits.

    Attributes:
        table: the key-averages table as text.
        table_path: ``<name>.table.txt``.
        trace_path: ``<name>.trace.json``, a Chrome trace (chrome://tracing, Perfetto).
        stacks_path: ``<name>.stacks.txt`` in the collapsed-stack format of
            flamegraph.pl / speedscope, or None when no stacks were recorded.
        sort_by: the column the table is sorted by.
        notes: what was skipped and why.
        profiler: the underlying ``torch.profiler.profile`` (for more analysis).
    """

    table: str = ""
    table_path: Path | None = None
    trace_path: Path | None = None
    stacks_path: Path | None = None
    sort_by: str = ""
    notes: list[str] = field(default_factory=list)
    profiler: Any = None


def export_chrome_trace(prof: Any, path: str | os.PathLike[str]) -> Path:
    """``prof.export_chrome_trace`` written atomically: the profiler opens the path itself,
    so it writes a temporary file beside ``path``, which then replaces it."""
    path = Path(path)
    tmp = temp_file_beside(path)
    try:
        prof.export_chrome_trace(tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return path


def _sort_key(use_cuda: bool, averages: Any) -> str:
    candidates = (["self_device_time_total", "self_cuda_time_total"] if use_cuda else []) + [
        "self_cpu_time_total"]
    for key in candidates:
        try:
            averages.table(sort_by=key, row_limit=1)
            return key
        except (AttributeError, KeyError, ValueError, TypeError):
            continue
    return "self_cpu_time_total"


@contextlib.contextmanager
def profile(
    out_dir: str | os.PathLike[str],
    *,
    name: str = "profile",
    device: torch.device | str | None = None,
    with_stack: bool = True,
    record_shapes: bool = True,
    row_limit: int = 30,
    profile_memory: bool = False,
) -> Iterator[ProfileResult]:
    """Profile the ``with`` block and write its reports to ``out_dir``.

    Example::

        with lab2bench.profile("prof", name="step") as prof:
            loss = model(x).sum()
            loss.backward()
        print(prof.table)

    Args:
        out_dir: folder for the files (created).
        name: file name stem.
        device: the device the work runs on; CUDA activity is recorded when it is a
            CUDA device (default: CUDA if available).
        with_stack: record Python stacks (needed for the flame-graph stacks).
        record_shapes: record input shapes of each operator.
        row_limit: rows of the table.
        profile_memory: also record tensor allocations.

    Yields:
        A ``ProfileResult`` filled in on exit (when the block raised, nothing is written).
    """
    dev = resolve_device(device)
    use_cuda = dev.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_cuda else [])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = ProfileResult()
    extra: dict[str, Any] = {}
    if with_stack:
        # Without a verbose experimental config, export_stacks finds no Python frames.
        with contextlib.suppress(AttributeError, TypeError):
            extra["experimental_config"] = torch._C._profiler._ExperimentalConfig(verbose=True)
    prof = torch.profiler.profile(activities=activities, record_shapes=record_shapes,
                                  with_stack=with_stack, profile_memory=profile_memory, **extra)
    result.profiler = prof
    with prof:
        yield result
        synchronize(dev)  # queued kernels belong to this profile

    averages = prof.key_averages()
    result.sort_by = _sort_key(use_cuda, averages)
    result.table = averages.table(sort_by=result.sort_by, row_limit=row_limit)
    result.table_path = atomic_write_text(out / f"{name}.table.txt", result.table + "\n")

    result.trace_path = export_chrome_trace(prof, out / f"{name}.trace.json")

    if not with_stack:
        result.notes.append("stacks not written: with_stack=False")
        return
    stacks_path = out / f"{name}.stacks.txt"
    # Weigh stacks by device time on CUDA; fall back to CPU time when no frame got any.
    metrics = (["self_cuda_time_total"] if use_cuda else []) + ["self_cpu_time_total"]
    tmp = temp_file_beside(stacks_path)
    try:
        for metric in metrics:
            prof.export_stacks(tmp, metric=metric)
            if os.path.getsize(tmp) > 0:
                os.replace(tmp, stacks_path)
                result.stacks_path = stacks_path
                break
        else:
            result.notes.append("stacks not written: the profiler recorded no Python stacks")
    except Exception as err:  # stack export is best-effort: the table and trace stand alone
        result.notes.append(f"stacks not written: {type(err).__name__}: {err}")
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
