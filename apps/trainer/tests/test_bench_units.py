"""Units of the bench package: overlap from traces, tensor accounting, the rank launcher."""

from __future__ import annotations

import pytest
import torch

from lab2_trainer.bench.trace_overlap import overlap_of_events
from lab2_trainer.bench.workload import optimizer_state_tensors, storage_bytes, tensor_breakdown


def kernel(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_overlap_counts_nccl_time_under_compute():
    events = [
        kernel("ampere_sgemm", 0, 100),
        kernel("elementwise", 150, 50),            # compute 0-100 and 150-200
        kernel("ncclKernel_AllReduce_RING", 50, 100),  # 50-150: half hidden
        kernel("ncclDevKernel_AllReduce", 180, 40),    # 180-220: 20 of 40 hidden
        {"ph": "X", "cat": "cpu_op", "name": "nccl:all_reduce", "ts": 0, "dur": 500},
    ]
    out = overlap_of_events(events)
    assert out["nccl_ms"] == pytest.approx(0.140)
    assert out["hidden_ms"] == pytest.approx(0.070)
    assert out["hidden_share"] == pytest.approx(0.5)


def test_overlap_none_without_nccl():
    assert overlap_of_events([kernel("gemm", 0, 10)]) is None


def test_storage_bytes_counts_views_once():
    flat = torch.randn(100)
    views = [flat[:30], flat[30:]]
    assert storage_bytes(views) == 400
    assert storage_bytes([torch.randn(3), torch.randn(5)]) == 32


def test_breakdown_of_adamw():
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    parts = tensor_breakdown(model, opt)
    n = sum(p.numel() for p in model.parameters())
    assert parts["param_bytes"] == parts["grad_bytes"] == 4 * n
    # exp_avg and exp_avg_sq, plus a scalar step tensor per parameter.
    assert 8 * n <= parts["optim_state_bytes"] <= 8 * n + 64
    assert len(optimizer_state_tensors(opt)) == 6


def test_ddp_rows_exposed_shares():
    # Two ranks, two variants; cumulative phase times in seconds per step.
    import argparse

    from lab2_trainer.bench.ddp import add_rows
    from lab2bench.suites import SuiteOutput

    def steps(total):
        return [{"forward": 0.01, "backward": 0.05, "sync": total - 0.01, "optimizer": total}]

    ranks = [{"params": 10, "local": {"steps": steps(0.100)}, "torch": {"steps": steps(0.125)},
              "overlap": {"torch": {"nccl_ms": 20.0, "hidden_ms": 15.0, "hidden_share": 0.75}}},
             {"params": 10, "local": {"steps": steps(0.098)}, "torch": {"steps": steps(0.120)},
              "overlap": {"torch": {"nccl_ms": 20.0, "hidden_ms": 17.0, "hidden_share": 0.85}}}]
    args = argparse.Namespace(world_size=2, device="cpu", precision="fp32", batch_size=1,
                              context_length=8, steps=1, rounds=1, warmup=0)
    out = SuiteOutput("ddp", None)
    add_rows(out, args, "tiny", ["local", "torch"], ranks)
    local, torch_row = out.rows
    assert local["nccl_exposed_share"] is None and local["exposed_share_vs_local"] == 0
    assert torch_row["step_ms"] == pytest.approx(125.0)  # the slowest rank's step
    assert torch_row["exposed_share_vs_local"] == pytest.approx(25.0 / 125.0)
    assert torch_row["overlap_share"] == pytest.approx(0.80)
    assert torch_row["nccl_exposed_share"] == pytest.approx(4.0 / 125.0)  # mean of 5 and 3 ms
