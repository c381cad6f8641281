"""Units of the benchmark scripts: overlap from traces, tensor accounting, the ddp rows, the
AdamW every variant steps."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def scripts(monkeypatch):
    """Import a script of ``apps/trainer/benchmarks`` by name, as the scripts import
    ``harness``."""
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module


def kernel(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_overlap_counts_nccl_time_under_compute(scripts):
    events = [
        kernel("ampere_sgemm", 0, 100),
        kernel("elementwise", 150, 50),            # compute 0-100 and 150-200
        kernel("ncclKernel_AllReduce_RING", 50, 100),  # 50-150: half hidden
        kernel("ncclDevKernel_AllReduce", 180, 40),    # 180-220: 20 of 40 hidden
        {"ph": "X", "cat": "cpu_op", "name": "nccl:all_reduce", "ts": 0, "dur": 500},
    ]
    out = scripts("ddp").overlap_of_events(events)
    assert out["nccl_ms"] == pytest.approx(0.140)
    assert out["hidden_ms"] == pytest.approx(0.070)
    assert out["hidden_share"] == pytest.approx(0.5)


def test_overlap_none_without_nccl(scripts):
    assert scripts("ddp").overlap_of_events([kernel("gemm", 0, 10)]) is None


def test_storage_bytes_counts_views_once(scripts):
    storage_bytes = scripts("harness").storage_bytes
    flat = torch.randn(100)
    views = [flat[:30], flat[30:]]
    assert storage_bytes(views) == 400
    assert storage_bytes([torch.randn(3), torch.randn(5)]) == 32


def test_breakdown_of_adamw(scripts):
    harness = scripts("harness")
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    parts = harness.held_bytes(model, opt)
    n = sum(p.numel() for p in model.parameters())
    assert parts["param_bytes"] == parts["grad_bytes"] == 4 * n
    # exp_avg and exp_avg_sq, plus a scalar step tensor per parameter.
    assert 8 * n <= parts["optim_state_bytes"] <= 8 * n + 64
    assert len(harness.optimizer_state_tensors(opt)) == 6


def test_ddp_rows_exposed_shares(scripts):
    # Two ranks, two variants; cumulative phase times in seconds per step.
    ddp, harness = scripts("ddp"), scripts("harness")

    def steps(total):
        return [{"forward": 0.01, "backward": 0.05, "sync": total - 0.01, "optimizer": total}]

    ranks = [{"params": 10, "local": {"steps": steps(0.100)}, "torch": {"steps": steps(0.125)},
              "overlap": {"torch": {"nccl_ms": 20.0, "hidden_ms": 15.0, "hidden_share": 0.75}}},
             {"params": 10, "local": {"steps": steps(0.098)}, "torch": {"steps": steps(0.120)},
              "overlap": {"torch": {"nccl_ms": 20.0, "hidden_ms": 17.0, "hidden_share": 0.85}}}]
    args = argparse.Namespace(world_size=2, device="cpu", precision="fp32", batch_size=1,
                              context_length=8, steps=1, rounds=1, warmup=0, timing="throughput",
                              backward_thread="caller", bucket_rule="reach")
    out = harness.Output("ddp", None)
    ddp.add_rows(out, args, "tiny", ["local", "torch"], ranks)
    local, torch_row = out.rows
    assert local["nccl_exposed_share"] is None and local["exposed_share_vs_local"] == 0
    assert torch_row["step_ms"] == pytest.approx(125.0)  # the slowest rank's step
    assert torch_row["exposed_share_vs_local"] == pytest.approx(25.0 / 125.0)
    assert torch_row["overlap_share"] == pytest.approx(0.80)
    assert torch_row["nccl_exposed_share"] == pytest.approx(4.0 / 125.0)  # mean of 5 and 3 ms


def test_variant_tables_cover_every_option(scripts):
    """The sharding kinds the scripts compare are the trainer's, and every ddp variant is a
    ``--ddp`` kind."""
    from lab2_trainer.recipe.layout import SHARDING_KINDS

    harness, ddp, stack = scripts("harness"), scripts("ddp"), scripts("stack")
    assert {kind for kind, _, _ in harness.SHARDINGS.values()} == set(SHARDING_KINDS)
    assert set(ddp.DDP_KIND.values()) == {"none", "naive", "flat", "individual", "bucketed",
                                          "torch"}
    assert {kind for _, kind, _ in stack.STACKS.values()} <= set(harness.SHARDINGS)


def test_variants_step_the_trainers_adamw(scripts):
    """``make_optimizer`` is the trainer's ``build_optimizer``: matrices decay, vectors do
    not, eps 1e-8, the trainer's betas; lr 1e-4."""
    from lab2_trainer.config import TrainSettings

    harness = scripts("harness")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = harness.make_optimizer(model)
    assert type(opt) is torch.optim.AdamW
    defaults = TrainSettings()
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == defaults.weight_decay and no_decay["weight_decay"] == 0.0
    assert [len(g["params"]) for g in opt.param_groups] == [1, 3]
    for g in opt.param_groups:
        assert g["lr"] == harness.LR == 1e-4 and g["eps"] == 1e-8
        assert g["betas"] == (defaults.beta1, defaults.beta2) and not g["fused"]


@pytest.mark.parametrize("kind, dtype, message",
                         [("none", torch.bfloat16, "reduce_dtype is for"),
                          ("individual", torch.bfloat16, "reduce_dtype is for"),
                          ("torch", torch.float32, "bfloat16 or float16")])
def test_grad_sync_reduce_dtype_only_where_it_exists(kind, dtype, message):
    """Refused before any wrapper is built (no process group needed)."""
    from lab2_trainer.parallel.parallelize import Options, ddp_wrapper

    model = torch.nn.Linear(2, 2)
    options = Options(ddp=kind, device=torch.device("cpu"), lr=1e-3, betas=(0.9, 0.95),
                      weight_decay=0.0, bucket_mb=25.0, reduce_dtype=dtype)
    with pytest.raises(ValueError, match=message):
        ddp_wrapper(model, kind, options)
