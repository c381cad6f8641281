"""Communication/computation overlap from a profiler's Chrome trace (CUDA runs).

The GPU timeline holds kernels: NCCL's (name containing "nccl") and everyone else's. The
time NCCL kernels ran while at least one compute kernel was running is communication hidden
under computation; the rest of the NCCL time was exposed (or overlapped only idle gaps).
"""

from __future__ import annotations

import json
from typing import Any


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo = max(a[i][0], b[j][0])
        hi = min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_of_events(events: list[dict[str, Any]]) -> dict[str, float] | None:
    """Overlap figures of Chrome-trace events (``ph == "X"`` kernels with ``ts``/``dur`` in us).

    Returns:
        ``{"nccl_ms", "compute_ms", "hidden_ms", "hidden_share"}``, or None when the trace
        has no NCCL kernel.
    """
    nccl: list[tuple[float, float]] = []
    compute: list[tuple[float, float]] = []
    for ev in events:
        if ev.get("ph") != "X" or ev.get("cat") != "kernel":
            continue
        start = float(ev.get("ts", 0.0))
        span = (start, start + float(ev.get("dur", 0.0)))
        (nccl if "nccl" in str(ev.get("name", "")).lower() else compute).append(span)
    if not nccl:
        return None
    nccl_m, compute_m = _merge(nccl), _merge(compute)
    nccl_total = sum(e - s for s, e in nccl_m)
    hidden = _intersection(nccl_m, compute_m)
    return {
        "nccl_ms": nccl_total / 1e3,
        "compute_ms": sum(e - s for s, e in compute_m) / 1e3,
        "hidden_ms": hidden / 1e3,
        "hidden_share": hidden / nccl_total if nccl_total > 0 else 0.0,
    }


def nccl_overlap(trace_path: str) -> dict[str, float] | None:
    """:func:`overlap_of_events` of a Chrome trace file."""
    with open(trace_path) as f:
        data = json.load(f)
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    return overlap_of_events(events)
