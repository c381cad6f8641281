"""Smoke runs of every ``lab2-train bench`` suite with ``--quick`` on the CPU, in-process.

Each run writes into a temporary folder; the JSONL records must parse back with lab2bench's
reader and carry the suite's figures, and the Markdown table must be printed.
"""

from __future__ import annotations

import math

import pytest

from lab2_trainer.bench.cli import main
from lab2bench import read_records


def run_suite(tmp_path, capsys, suite: str, *extra: str) -> list[dict]:
    out = tmp_path / suite
    assert main([suite, "--quick", "--out", str(out), *extra]) == 0
    printed = capsys.readouterr().out
    assert "|---" in printed, printed
    assert (out / f"{suite}.md").read_text().count("|") > 4
    records = read_records(out / f"{suite}.jsonl")
    assert records and all(r["suite"] == suite for r in records)
    return records


@pytest.mark.parametrize(
    "suite, key, extra",
    [("e2e", "mean_ms", ()),
     ("precision", "speedup_vs_fp32", ("--modes", "forward_backward")),
     ("compile", "speedup_vs_eager", ("--modes", "forward_backward", "--backend", "eager")),
     ("norm", "speedup_vs_reference", ()),
     ("memory", "peak_MiB", ())],
)
def test_single_device_suites(tmp_path, capsys, suite, key, extra):
    records = run_suite(tmp_path, capsys, suite, *extra)
    for r in records:
        value = r["metrics"][key]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, r
    if suite == "e2e":
        modes = {r["config"]["mode"] for r in records}
        assert modes == {"forward", "forward_backward"}
        assert (tmp_path / suite / "e2e-time.png").stat().st_size > 0
    if suite == "norm":
        norms = {r["config"]["norm"] for r in records}
        assert norms == {"tritonnorm", "reference", "torch", "layernorm"}
    if suite == "memory":
        step = [r for r in records if r["config"]["region"] == "train_step"][0]
        # AdamW keeps two tensors per parameter: its state is twice the parameters.
        m = step["metrics"]
        assert m["optim_state_MiB"] == pytest.approx(2 * m["param_MiB"], rel=0.01)


def test_norm_suite_rounds_and_profile(tmp_path, capsys):
    """Interleaved rounds, and ``--profile``: the norm ops' CPU µs per call in the model."""
    records = run_suite(tmp_path, capsys, "norm", "--preset", "tiny", "--rounds", "2",
                        "--modes", "forward_backward", "--profile", "--profile-mode",
                        "forward_backward", "--profile-top", "5", "--profile-trace")
    for r in records:
        assert r["config"]["rounds"] == 2 and len(r["metrics"]["round_means_ms"]) == 2
    out = tmp_path / "norm"
    assert "norm ops per call inside the model" in (out / "norm-profile.md").read_text()
    profiles = read_records(out / "norm-profile.jsonl", suite="norm-profile")
    summary = {r["config"]["norm"]: r["metrics"] for r in profiles
               if r["config"]["table"] == "norm_ops"}
    assert set(summary) == {"tritonnorm", "reference", "torch", "layernorm"}
    for m in summary.values():
        assert m["norm_calls_per_step"] == 2 * 3 + 1  # tiny: 3 blocks of 2 norms, final norm
        assert m["fwd_cpu_us"] > 0 and m["bwd_cpu_us"] > 0 and m["step_cpu_ms"] > 0
        assert m["norm_share"] > 0
    # A call is the residual add and the norm after it (add_and_norm). Off CUDA tritonnorm
    # takes its PyTorch path: the add, the cast of the sum, then the norm's Function; the
    # add also occurs outside the norms, so the figures are means ("exact" no).
    assert summary["tritonnorm"]["fwd_op"] == "aten::add + aten::to + RMSNormTorchFunction"
    assert "RMSNormTorchFunctionBackward" in summary["tritonnorm"]["bwd_op"]
    assert summary["tritonnorm"]["exact"] == "no"
    assert summary["layernorm"]["bwd_op"] == "NativeLayerNormBackward0 + AddBackward0"
    top = [r for r in profiles if r["config"]["table"] == "top_ops"]
    for norm in summary:
        ranks = [r["config"]["rank"] for r in top if r["config"]["norm"] == norm]
        assert ranks == [1, 2, 3, 4, 5]
    assert all(r["metrics"]["self_cpu_us"] > 0 for r in top)
    assert (out / "norm-profile-tiny-tritonnorm.trace.json").stat().st_size > 0


def test_ddp_suite(tmp_path, capsys):
    records = run_suite(tmp_path, capsys, "ddp", "--bucket-mb", "0.01", "--steps", "1")
    by_variant = {r["config"]["variant"]: r["metrics"] for r in records}
    assert set(by_variant) == {"local", "naive", "flat", "individual", "bucketed:0.01", "torch"}
    assert by_variant["torch"]["ratio_to_torch"] == pytest.approx(1.0)
    for m in by_variant.values():
        assert m["step_ms"] > 0 and m["sync_wait_ms"] >= 0 and m["n_steps"] == 1
        assert 0 <= m["exposed_share_vs_local"] <= 1
    assert (tmp_path / "ddp" / "ddp-bucket-sweep.png").exists()


def test_ddp_suite_bfloat16_wire_variants(tmp_path, capsys):
    records = run_suite(tmp_path, capsys, "ddp", "--variants", "bucketed_bf16,torch_bf16",
                        "--bucket-mb", "0.01", "--steps", "1")
    by_variant = {r["config"]["variant"]: r["metrics"] for r in records}
    assert set(by_variant) == {"bucketed_bf16:0.01", "torch_bf16"}
    assert by_variant["bucketed_bf16:0.01"]["step_ms"] > 0


def test_zero_suite(tmp_path, capsys):
    """Every sharding kind in one launch, with bytes sent and bytes held counted."""
    records = run_suite(tmp_path, capsys, "zero", "--steps", "1")
    by_variant = {r["config"]["variant"]: r["metrics"] for r in records}
    assert set(by_variant) == {"adamw", "zero1", "zero2", "zero1-allreduce", "torch_zero",
                               "fsdp", "fsdp-keep"}
    adamw = by_variant["adamw"]
    # 2 ranks: DDP's all-reduce and ZeRO's reduce-scatter + all-gather send 2 x the
    # parameters' bytes (buckets pad zero1's a little); the broadcast pairings about 3.
    assert adamw["sent_vs_params"] == pytest.approx(2.0, rel=0.01)
    for name in ("zero1", "zero2"):
        assert 2.0 <= by_variant[name]["sent_vs_params"] <= 2.05
    for name in ("zero1-allreduce", "torch_zero"):
        assert 2.4 <= by_variant[name]["sent_vs_params"] <= 3.05
    total_state = sum(adamw["optim_state_bytes_per_rank"]) / 2  # every rank holds it all
    for name in ("zero1", "zero2", "zero1-allreduce", "torch_zero", "fsdp", "fsdp-keep"):
        m = by_variant[name]
        # Every parameter's state lives on exactly one rank.
        assert sum(m["optim_state_bytes_per_rank"]) == pytest.approx(total_state, rel=0.01)
        assert m["step_ms"] > 0
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
    assert by_variant["zero2"]["grad_MiB"] < by_variant["zero1"]["grad_MiB"]


def test_stack_suite(tmp_path, capsys):
    records = run_suite(tmp_path, capsys, "stack", "--steps", "1")
    by_variant = {r["config"]["variant"]: r for r in records}
    assert set(by_variant) == {"ours", "ours-zero2", "ours-allreduce", "ours-fsdp", "pytorch",
                               "pytorch-fsdp", "pytorch-fsdp-keep"}
    assert by_variant["ours"]["config"]["norm"] == "tritonnorm"
    assert by_variant["ours"]["config"]["sharding"] == "zero1"
    assert by_variant["pytorch-fsdp"]["config"]["norm"] != "tritonnorm"
    assert by_variant["ours"]["metrics"]["step_vs_first"] == pytest.approx(1.0)
    assert by_variant["pytorch"]["metrics"]["ratio_to_pytorch"] == pytest.approx(1.0)
    assert by_variant["ours"]["metrics"]["tokens_per_s"] > 0


def test_stack_suite_latency_timing(tmp_path, capsys):
    # Throughput by default (steps back to back); latency: a barrier before each step.
    records = run_suite(tmp_path, capsys, "stack", "--steps", "2", "--timing", "latency",
                        "--variants", "ours,pytorch")
    assert {r["config"]["timing"] for r in records} == {"after a barrier"}
    assert all(r["metrics"]["step_ms"] > 0 for r in records)
    default = run_suite(tmp_path / "default", capsys, "stack", "--steps", "1",
                        "--variants", "ours,pytorch")
    assert {r["config"]["timing"] for r in default} == {"back to back"}


def test_stack_suite_compiled(tmp_path, capsys):
    # Both stacks compiled the same way (here by the "eager" backend, which only traces);
    # MFU empty on the CPU.
    records = run_suite(tmp_path, capsys, "stack", "--steps", "1", "--compile",
                        "--backend", "eager", "--variants", "ours,ours-fsdp,pytorch")
    by_variant = {r["config"]["variant"]: r for r in records}
    assert {r["config"]["compiled"] for r in records} == {"eager"}  # the backend's name
    assert by_variant["ours"]["metrics"]["tokens_per_s"] > 0
    assert all(r["metrics"]["mfu"] is None for r in records)


def test_prints_without_out(capsys):
    assert main(["e2e", "--quick", "--modes", "forward"]) == 0
    assert "| micro" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [(["e2e", "--quick", "--preset", "huge"], "unknown preset"),
     (["e2e", "--quick", "--steps", "0"], "--steps must be >= 1"),
     (["ddp", "--quick", "--variants", "magic"], "unknown variant"),
     (["e2e", "--quick", "--modes", "sideways"], "unknown mode")],
)
def test_bad_options_exit_with_one_line(argv, message):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert message in str(info.value)


def test_lab2bench_runs_the_trainer_suites(tmp_path, capsys):
    """The entry points of ``lab2bench.suites``: ``lab2bench list`` shows ``train-<suite>``,
    and ``lab2bench train-e2e`` is ``lab2-train bench e2e`` (same records and files)."""
    from lab2_trainer.bench.cli import SUITES
    from lab2bench.cli import main as lab2bench_main

    assert lab2bench_main(["list"]) == 0
    listed = capsys.readouterr().out
    assert all(f"train-{name}" in listed for name in SUITES), listed
    out = tmp_path / "e2e"
    assert lab2bench_main(["train-e2e", "--quick", "--modes", "forward", "--out", str(out)]) == 0
    assert "| micro" in capsys.readouterr().out
    records = read_records(out / "e2e.jsonl")
    assert records and all(r["suite"] == "e2e" for r in records)
    assert {r["config"]["mode"] for r in records} == {"forward"}
    assert (out / "e2e.md").exists()
