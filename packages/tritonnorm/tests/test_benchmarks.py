"""tritonnorm's benchmark scripts (``benchmarks/``) in their quick form on the CPU, and the
Triton kernels in them under the interpreter. The scripts run in this process (their
``main(argv)``), which has torch imported already."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path

import pytest

from lab2bench import read_records

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def script(name: str):
    """The module of ``benchmarks/<name>.py`` (which imports its sibling ``impls``)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"tritonnorm_benchmarks_{name}",
                                                  BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def _interpreter_only() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (nox -s triton-interpret)")


def test_bad_option_is_a_usage_error():
    with pytest.raises(SystemExit) as err:
        script("kernel_table").main(["--quick", "--impl", "no-such-impl"])
    assert err.value.code == 2


def test_kernel_table_quick(tmp_path, capsys):
    out = tmp_path / "out"
    code = script("kernel_table").main(["--quick", "--out", str(out), "--hidden", "64,256",
                                        "--rows", "8"])
    assert code == 0
    stdout = capsys.readouterr().out
    assert "| dtype | H | rows | impl |" in stdout
    records = read_records(out / "norm.jsonl", suite="norm")
    copy = [r for r in records if r["config"]["impl"] == "copy"]
    assert len(copy) == 1 and copy[0]["metrics"]["copy_gbps"] > 0
    measured = [r for r in records if r["metrics"]["status"] == "ok" and r not in copy]
    impls = {r["config"]["impl"] for r in measured}
    assert {"torch-naive", "F.layer_norm"} <= impls
    # tritonnorm.rms_norm runs tritonnorm's kernels: the table leaves it out unless named.
    assert "tritonnorm.rms_norm" not in {r["config"]["impl"] for r in records}
    assert {r["config"]["H"] for r in measured} == {64, 256}
    for r in measured:
        assert r["config"]["timing"] == "eager"  # the CPU default
        m = r["metrics"]
        assert m["fwd_ms"] > 0 and m["fwdbwd_ms"] > 0 and m["fwd_pct"] > 0
        assert m["rel_err"] < 1e-5
        assert r["env"]["device"] == "cpu"
    assert (out / "norm.md").read_text().startswith("# RMSNorm")
    assert (out / "norm_fwdbwd_float32_eager.png").read_bytes()[:4] == b"\x89PNG"


def test_kernel_table_graph_timing_needs_cuda():
    with pytest.raises(SystemExit) as err:
        script("kernel_table").main(["--quick", "--timing", "graph"])
    assert err.value.code == 2


def test_kernel_table_fused_add_quick(capsys):
    assert script("kernel_table").main(["--quick", "--fused-add", "--hidden", "64",
                                        "--rows", "8"]) == 0
    assert "| float32 | 64 | 8 | tritonnorm | eager |" in capsys.readouterr().out


def test_kernel_table_crossover_quick(tmp_path):
    """--crossover: rms_norm with each eager path forced, per variant, checked against
    float64 with the variant's gain (Gemma's 1 + w, no weight's 1)."""
    out = tmp_path / "out"
    assert script("kernel_table").main(["--quick", "--crossover", "--hidden", "64", "--rows",
                                        "8", "--out", str(out)]) == 0
    rows = read_records(out / "norm.jsonl", suite="norm")
    measured = {r["config"]["impl"]: r["metrics"] for r in rows
                if r["config"]["impl"] != "copy"}
    assert set(measured) == {f"{path}/{variant}" for path in ("kernels", "F.rms_norm")
                             for variant in ("plain", "gemma", "no-weight")}
    for m in measured.values():
        assert m["status"] == "ok" and m["fwdbwd_ms"] > 0 and m["rel_err"] < 1e-5, m


@pytest.mark.triton
def test_kernel_table_runs_the_triton_kernels(tmp_path):
    """In the triton-interpret session: tritonnorm's Triton kernels in the table, and the
    fused add's kernels alone."""
    _interpreter_only()
    out = tmp_path / "out"
    kernel_table = script("kernel_table")
    code = kernel_table.main(["--quick", "--out", str(out), "--impl", "tritonnorm,torch-naive",
                              "--hidden", "64", "--rows", "8", "--repeats", "1",
                              "--warmup", "0"])
    assert code == 0
    rows = [r for r in read_records(out / "norm.jsonl") if r["config"]["impl"] == "tritonnorm"]
    assert rows and rows[0]["metrics"]["status"] == "ok", rows
    assert rows[0]["metrics"]["rel_err"] < 1e-5
    assert rows[0]["metrics"]["fwdbwd_vs_best"] > 0
    assert kernel_table.main(["--quick", "--fused-add", "--hidden", "64", "--rows", "8",
                              "--repeats", "1", "--warmup", "0", "--out", str(out)]) == 0
    assert "Kernels alone" in (out / "norm.md").read_text()


def test_host_time_quick(tmp_path, capsys):
    host_time = script("host_time")
    out = tmp_path / "out"
    code = host_time.main(["--quick", "--out", str(out), "--rounds", "2", "--calls", "4"])
    assert code == 0
    stdout = capsys.readouterr().out
    assert "| dtype | H | rows | impl | fwd µs | bwd µs |" in stdout
    records = read_records(out / "norm-host.jsonl", suite="norm-host")
    by_impl = {r["config"]["impl"]: r for r in records}
    ok = {name for name, r in by_impl.items() if r["metrics"]["status"] == "ok"}
    # Off CUDA, tritonnorm's entry point takes its PyTorch path; the Triton row is skipped.
    assert {host_time.OP, host_time.OP_EACH, "torch-naive", "tritonnorm-torch",
            "tritonnorm.rms_norm", "F.rms_norm", "F.layer_norm"} <= ok
    assert "compile-naive" not in by_impl  # left out of --quick
    for name in ok:
        r = by_impl[name]
        assert r["config"]["device"] == "cpu" and r["config"]["calls"] == 4
        m = r["metrics"]
        for key in ("fwd_us", "bwd_us", "fwdbwd_us", "fwd_nograd_us", "fwdbwd_ops",
                    "fwdbwd_min_us"):
            assert _positive(m[key]), (name, key, m)
        assert all(len(v) == 2 for v in m["samples_us"].values())
        if name not in (host_time.OP, host_time.OP_EACH):
            assert _positive(m["fwdbwd_vs_ref"]), (name, m)
    assert by_impl[host_time.OP]["metrics"]["fwdbwd_ops"] == pytest.approx(1.0)
    for r in records:
        assert r["metrics"]["status"] in ("ok", "skipped"), r
    assert (out / "norm-host.md").read_text().startswith("# RMSNorm host cost")


def test_host_time_named_impls(capsys):
    code = script("host_time").main(["--quick", "--impl", "torch-naive,F.rms_norm",
                                     "--rounds", "1", "--calls", "2", "--warmup", "0",
                                     "--hidden", "32,48", "--rows", "4"])
    assert code == 0
    table = capsys.readouterr().out
    assert table.count("| torch-naive |") == 2 and table.count("| F.rms_norm |") == 2
    assert "F.layer_norm" not in table


@pytest.mark.triton
def test_host_time_runs_the_triton_kernels(tmp_path):
    """In the triton-interpret session: tritonnorm's Triton path in the host-time script."""
    _interpreter_only()
    out = tmp_path / "out"
    code = script("host_time").main(["--quick", "--out", str(out), "--impl", "tritonnorm",
                                     "--rounds", "1", "--calls", "2", "--warmup", "0"])
    assert code == 0
    rows = [r for r in read_records(out / "norm-host.jsonl")
            if r["config"]["impl"] == "tritonnorm"]
    assert rows and rows[0]["metrics"]["status"] == "ok", rows
    assert rows[0]["metrics"]["bwd_us"] > 0


def test_in_model_variants_set_options_and_machinery_switches():
    from tritonnorm._machinery import SWITCHES
    from tritonnorm.ops import OPTIONS

    in_model = script("in_model")
    for name, options in in_model.MACHINERY.items():
        with in_model.switched(options):
            assert OPTIONS.eager_dispatch == "kernels"
            assert all(getattr(SWITCHES, k) == v for k, v in options.items()
                       if k != "eager_dispatch"), name
    assert OPTIONS.eager_dispatch == "auto" and SWITCHES.launch_plans and SWITCHES.fold_dw_sum


def test_in_model_measures_a_model_of_its_own():
    """in_model.py's LM is defined in the script: no import of the trainer, the same weights
    and logits with either norm, tritonnorm's fused add + norm in every norm's place."""
    import ast

    import torch
    from torch import nn

    from tritonnorm.nn import FusedAddRMSNorm

    tree = ast.parse((BENCHMARKS / "in_model.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(name.split(".")[0] == "lab2_trainer" for name in imported), imported
    in_model = script("in_model")
    plain, (x, y) = in_model.lm_model("tiny", "torch", 2, device="cpu")
    fused, (x2, _) = in_model.lm_model("tiny", "tritonnorm", 2, device="cpu")
    assert x.shape == y.shape == (2, in_model.LM_CONTEXT) and torch.equal(x, x2)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets: the inputs shifted by one
    n_norms = 2 * in_model.PRESETS["tiny"]["n_layers"] + 1
    assert sum(type(m) is nn.RMSNorm for m in plain.modules()) == n_norms
    assert sum(isinstance(m, FusedAddRMSNorm) for m in fused.modules()) == n_norms
    assert plain.state_dict().keys() == fused.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(),
                                                 fused.state_dict().values()))
    assert plain.head.weight is plain.embed.weight
    logits = plain(x[:, :16])
    assert logits.shape == (2, 16, in_model.LM_VOCAB)
    torch.testing.assert_close(fused(x[:, :16]), logits, rtol=1e-5, atol=1e-5)
    fused(x[:, :16]).logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in fused.parameters())


def test_in_model_refuses_an_unknown_preset_before_building_anything():
    with pytest.raises(SystemExit) as err:
        script("in_model").main(["--presets", "small,huge"])
    assert err.value.code == 2
