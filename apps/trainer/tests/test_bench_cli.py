"""Smoke runs of the trainer's benchmark scripts (``apps/trainer/benchmarks``) with ``--quick``
on the CPU, each in its own process.

Each run writes into a temporary folder; the JSONL records must parse back with lab2bench's
reader and carry the script's figures, and the Markdown table must be printed.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from lab2bench import read_records

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def run_script(script: str, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / f"{script}.py"), *argv],
                          capture_output=True, text=True, timeout=timeout)


def run_quick(tmp_path, script: str, *extra: str) -> list[dict]:
    out = tmp_path / script
    done = run_script(script, "--quick", "--out", str(out), *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "|---" in done.stdout, done.stdout
    assert (out / f"{script}.md").read_text().count("|") > 4
    records = read_records(out / f"{script}.jsonl")
    assert records and all(r["suite"] == script for r in records)
    return records


@pytest.mark.parametrize(
    "compare, key, extra",
    [("none", "mean_ms", ()),
     ("precision", "speedup_vs_fp32", ("--modes", "forward_backward")),
     ("compile", "speedup_vs_eager", ("--modes", "forward_backward", "--backend", "eager")),
     ("norm", "speedup_vs_reference", ())],
)
def test_step_time(tmp_path, compare, key, extra):
    records = run_quick(tmp_path, "step_time", "--compare", compare, *extra)
    for r in records:
        value = r["metrics"][key]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, r
    if compare == "none":
        assert {r["config"]["mode"] for r in records} == {"forward", "forward_backward"}
        assert (tmp_path / "step_time" / "step_time-time.png").stat().st_size > 0
    if compare == "norm":
        assert {r["config"]["norm"] for r in records} == {"tritonnorm", "reference", "torch",
                                                           "layernorm"}


def test_step_time_rounds(tmp_path):
    """Interleaved rounds: each round's mean is kept."""
    records = run_quick(tmp_path, "step_time", "--compare", "norm", "--norms",
                        "tritonnorm,reference", "--rounds", "2", "--modes", "forward_backward")
    for r in records:
        assert r["config"]["rounds"] == 2 and len(r["metrics"]["round_means_ms"]) == 2


def test_memory(tmp_path):
    records = run_quick(tmp_path, "memory")
    step = [r for r in records if r["config"]["region"] == "train_step"][0]
    # AdamW keeps two tensors per parameter: its state is twice the parameters.
    m = step["metrics"]
    assert m["peak_MiB"] > 0
    assert m["optim_state_MiB"] == pytest.approx(2 * m["param_MiB"], rel=0.01)


def test_ddp(tmp_path):
    records = run_quick(tmp_path, "ddp", "--bucket-mb", "0.01", "--steps", "1")
    by_variant = {r["config"]["variant"]: r["metrics"] for r in records}
    assert set(by_variant) == {"local", "naive", "flat", "individual", "bucketed:0.01", "torch"}
    assert by_variant["torch"]["ratio_to_torch"] == pytest.approx(1.0)
    for m in by_variant.values():
        assert m["step_ms"] > 0 and m["sync_wait_ms"] >= 0 and m["n_steps"] == 1
        assert 0 <= m["exposed_share_vs_local"] <= 1
    assert (tmp_path / "ddp" / "ddp-bucket-sweep.png").exists()


def test_ddp_bfloat16_wire_variants(tmp_path):
    records = run_quick(tmp_path, "ddp", "--variants", "bucketed_bf16,torch_bf16",
                        "--bucket-mb", "0.01", "--steps", "1")
    by_variant = {r["config"]["variant"]: r["metrics"] for r in records}
    assert set(by_variant) == {"bucketed_bf16:0.01", "torch_bf16"}
    assert by_variant["bucketed_bf16:0.01"]["step_ms"] > 0


def test_zero(tmp_path):
    """Every sharding kind in one launch, with bytes sent and bytes held counted."""
    records = run_quick(tmp_path, "zero", "--steps", "1")
    by_variant = {r["config"]["variant"]: r["metrics"] for r in records}
    assert set(by_variant) == {"adamw", "zero1", "zero2", "zero1-allreduce", "torch_zero",
                               "fsdp", "fsdp-keep", "zero3", "zero3-keep"}
    adamw = by_variant["adamw"]
    # 2 ranks: DDP's all-reduce and ZeRO's reduce-scatter + all-gather send 2 x the
    # parameters' bytes (buckets pad zero1's a little); the broadcast pairings about 3.
    assert adamw["sent_vs_params"] == pytest.approx(2.0, rel=0.01)
    for name in ("zero1", "zero2"):
        assert 2.0 <= by_variant[name]["sent_vs_params"] <= 2.05
    for name in ("zero1-allreduce", "torch_zero"):
        assert 2.4 <= by_variant[name]["sent_vs_params"] <= 3.05
    total_state = sum(adamw["optim_state_bytes_per_rank"]) / 2  # every rank holds it all
    for name in ("zero1", "zero2", "zero1-allreduce", "torch_zero", "fsdp", "fsdp-keep",
                 "zero3", "zero3-keep"):
        m = by_variant[name]
        # Every parameter's state lives on exactly one rank.
        assert sum(m["optim_state_bytes_per_rank"]) == pytest.approx(total_state, rel=0.01)
        assert m["step_ms"] > 0
    # zero3 sends 3 x with resharding (gathered for forward and again for backward,
    # reduce-scattered) less the root unit's backward gather (it stays gathered: here the
    # tied embedding, a large share of the micro model), 2 x without; padding adds a little.
    assert 2.2 < by_variant["zero3"]["sent_vs_params"] < 3.0
    assert by_variant["zero3-keep"]["sent_vs_params"] == pytest.approx(2.0, rel=0.05)
    # FSDP2 sends 3 x with resharding (parameters gathered for forward and again for
    # backward, gradients reduce-scattered), 2 x without; only where this torch's FSDP2
    # calls collectives that count_collectives sees.
    if by_variant["fsdp"]["sent_vs_params"] > 0:
        assert by_variant["fsdp-keep"]["sent_vs_params"] == pytest.approx(2.0, rel=0.05)
        assert by_variant["fsdp"]["sent_vs_params"] == pytest.approx(3.0, rel=0.05)
    # Stage 2 holds 1/N of DDP + AdamW's gradients and state, plus one bucket of full
    # gradients (the send buffer; here one bucket is the whole tiny model).
    one_bucket = adamw["grad_MiB"]
    adamw_held = adamw["grad_MiB"] + adamw["optim_state_MiB"]
    zero2 = by_variant["zero2"]
    assert zero2["grad_MiB"] + zero2["optim_state_MiB"] <= 1.01 * (adamw_held / 2 + one_bucket)
    assert zero2["grad_MiB"] < by_variant["zero1"]["grad_MiB"]


def test_stack(tmp_path):
    records = run_quick(tmp_path, "stack", "--steps", "1")
    by_variant = {r["config"]["variant"]: r for r in records}
    assert set(by_variant) == {"ours", "ours-zero2", "ours-allreduce", "ours-zero3", "ours-fsdp",
                               "pytorch", "pytorch-fsdp", "pytorch-fsdp-keep"}
    assert by_variant["ours"]["config"]["norm"] == "tritonnorm"
    assert by_variant["ours"]["config"]["sharding"] == "zero1"
    assert by_variant["pytorch-fsdp"]["config"]["norm"] != "tritonnorm"
    assert by_variant["ours"]["metrics"]["step_vs_first"] == pytest.approx(1.0)
    assert by_variant["pytorch"]["metrics"]["ratio_to_pytorch"] == pytest.approx(1.0)
    assert by_variant["ours"]["metrics"]["tokens_per_s"] > 0


def test_stack_latency_timing(tmp_path):
    # Throughput by default (steps back to back); latency: a barrier before each step.
    records = run_quick(tmp_path, "stack", "--steps", "2", "--timing", "latency",
                        "--variants", "ours,pytorch")
    assert {r["config"]["timing"] for r in records} == {"after a barrier"}
    assert all(r["metrics"]["step_ms"] > 0 for r in records)
    default = run_quick(tmp_path / "default", "stack", "--steps", "1",
                        "--variants", "ours,pytorch")
    assert {r["config"]["timing"] for r in default} == {"back to back"}


def test_stack_compiled(tmp_path):
    # Both stacks compiled the same way (here by the "eager" backend, which only traces);
    # MFU empty on the CPU.
    records = run_quick(tmp_path, "stack", "--steps", "1", "--compile", "--backend", "eager",
                        "--variants", "ours,ours-fsdp,pytorch")
    by_variant = {r["config"]["variant"]: r for r in records}
    assert {r["config"]["compiled"] for r in records} == {"eager"}  # the backend's name
    assert by_variant["ours"]["metrics"]["tokens_per_s"] > 0
    assert all(r["metrics"]["mfu"] is None for r in records)


def test_prints_without_out():
    done = run_script("step_time", "--quick", "--modes", "forward")
    assert done.returncode == 0 and "| micro" in done.stdout, done.stderr[-2000:]


@pytest.mark.parametrize(
    "argv, message",
    [(["step_time", "--quick", "--preset", "huge"], "unknown preset"),
     (["step_time", "--quick", "--steps", "0"], "--steps must be >= 1"),
     (["ddp", "--quick", "--variants", "magic"], "unknown variant"),
     (["step_time", "--quick", "--modes", "sideways"], "unknown mode")],
)
def test_bad_options_exit_with_a_usage_error(argv, message):
    done = run_script(*argv)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
