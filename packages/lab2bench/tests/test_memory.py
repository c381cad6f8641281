"""peak_memory and memory_snapshot on the CPU."""

from __future__ import annotations

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

