"""``lab2bench norm-host``: the host-cost suite runs in quick mode on the CPU and records
positive per-call figures for every implementation that can run here (no timing claims)."""

from __future__ import annotations

import math

import pytest

from lab2bench import read_records
from lab2bench.cli import main
from tritonnorm.bench import norm_host


def _positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_norm_host_quick(tmp_path, capsys):
    pytest.importorskip("tritonnorm")
    out = tmp_path / "out"
    code = main(["norm-host", "--quick", "--out", str(out), "--rounds", "2", "--calls", "4"])
    assert code == 0
    stdout = capsys.readouterr().out
    assert "| dtype | H | rows | impl | fwd µs | bwd µs |" in stdout
    records = read_records(out / "norm-host.jsonl", suite="norm-host")
    by_impl = {r["config"]["impl"]: r for r in records}
    ok = {name for name, r in by_impl.items() if r["metrics"]["status"] == "ok"}
    # Off CUDA, tritonnorm's entry point takes its PyTorch path; the Triton row is skipped.
    assert {norm_host.OP, norm_host.OP_EACH, "torch-naive", "tritonnorm-torch",
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
        if name not in (norm_host.OP, norm_host.OP_EACH):
            assert _positive(m["fwdbwd_vs_ref"]), (name, m)
    assert by_impl[norm_host.OP]["metrics"]["fwdbwd_ops"] == pytest.approx(1.0)
    for r in records:
        assert r["metrics"]["status"] in ("ok", "skipped"), r
    assert (out / "norm-host.md").read_text().startswith("# RMSNorm host cost")


def test_norm_host_named_impls_and_list(tmp_path, capsys):
    assert main(["list"]) == 0
    assert "norm-host" in capsys.readouterr().out
    code = main(["norm-host", "--quick", "--impl", "naive,rms_norm", "--rounds", "1",
                 "--calls", "2", "--warmup", "0", "--hidden", "32,48", "--rows", "4"])
    assert code == 0
    table = capsys.readouterr().out
    assert table.count("| torch-naive |") == 2 and table.count("| F.rms_norm |") == 2
    assert "F.layer_norm" not in table


def test_norm_suite_leaves_out_the_entry_point_row():
    """tritonnorm.rms_norm runs tritonnorm's kernels: the bandwidth suite skips it unless named."""
    from tritonnorm.bench.norm_impls import IMPLS

    assert not IMPLS["tritonnorm.rms_norm"].in_norm_default
    assert all(impl.in_norm_default for name, impl in IMPLS.items()
               if name != "tritonnorm.rms_norm")


@pytest.mark.triton
def test_norm_host_runs_the_triton_kernels(tmp_path):
    """In the triton-interpret session: tritonnorm's Triton path in the host suite."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (nox -s triton-interpret)")
    pytest.importorskip("tritonnorm")
    out = tmp_path / "out"
    code = main(["norm-host", "--quick", "--out", str(out), "--impl", "tritonnorm",
                 "--rounds", "1", "--calls", "2", "--warmup", "0"])
    assert code == 0
    rows = [r for r in read_records(out / "norm-host.jsonl")
            if r["config"]["impl"] == "tritonnorm"]
    assert rows and rows[0]["metrics"]["status"] == "ok", rows
    assert rows[0]["metrics"]["bwd_us"] > 0
