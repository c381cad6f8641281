"""peak_memory, memory_snapshot and profile on the CPU."""

from __future__ import annotations

import json

import pytest
import torch

import lab2bench


def test_peak_memory_cpu_sees_an_allocation():
    with lab2bench.peak_memory("cpu", interval=0.0005) as mem:
        big = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, touched
        big.add_(1)
        del big
    assert mem.source == "rss-sampled"
    assert mem.peak_bytes > 0 and mem.start_bytes > 0 and mem.end_bytes > 0
    assert mem.peak_bytes >= max(mem.start_bytes, mem.end_bytes)
    assert mem.increase_bytes > 32 * 1024 * 1024
    assert mem.to_dict()["device"] == "cpu"


def test_memory_snapshot_on_cpu_warns_and_writes_nothing(tmp_path):
    with pytest.warns(RuntimeWarning, match="CUDA"), \
            lab2bench.memory_snapshot(tmp_path / "snap", device="cpu") as snap:
        torch.ones(10).sum()
    assert snap.pickle_path is None and snap.html_path is None
    assert list(tmp_path.iterdir()) == []


def test_profile_writes_table_trace_and_stacks(tmp_path):
    a = torch.randn(32, 32)
    with lab2bench.profile(tmp_path, name="tiny", device="cpu") as prof, \
            torch.profiler.record_function("matmul-block"):
        (a @ a).relu().sum()
    assert "matmul-block" in prof.table
    assert prof.table_path.read_text().strip() == prof.table.strip()
    trace = json.loads(prof.trace_path.read_text())
    assert "traceEvents" in trace
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "matmul-block" in names
    if prof.stacks_path is not None:  # stack export is best effort
        assert prof.stacks_path.stat().st_size > 0
    else:
        assert prof.notes
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_profile_without_stacks(tmp_path):
    with lab2bench.profile(tmp_path, name="nostack", device="cpu", with_stack=False) as prof:
        torch.ones(4).sum()
    assert prof.stacks_path is None and prof.trace_path.exists()
    assert not (tmp_path / "nostack.stacks.txt").exists()
