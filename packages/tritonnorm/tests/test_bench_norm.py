"""``lab2bench norm`` (tritonnorm[bench]): the quick run on the CPU, its options, and the
Triton kernels in the suite under the interpreter."""

from __future__ import annotations

import pytest

from lab2bench import read_records
from lab2bench.cli import main


def test_bad_option_is_a_usage_error():
    with pytest.raises(SystemExit) as err:
        main(["norm", "--quick", "--impl", "no-such-impl"])
    assert err.value.code == 2


def test_norm_quick(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["norm", "--quick", "--out", str(out), "--hidden", "64,256", "--rows", "8"])
    assert code == 0
    stdout = capsys.readouterr().out
    assert "| dtype | H | rows | impl |" in stdout
    records = read_records(out / "norm.jsonl", suite="norm")
    copy = [r for r in records if r["config"]["impl"] == "copy"]
    assert len(copy) == 1 and copy[0]["metrics"]["copy_gbps"] > 0
    measured = [r for r in records if r["metrics"]["status"] == "ok" and r not in copy]
    impls = {r["config"]["impl"] for r in measured}
    assert {"torch-naive", "F.layer_norm"} <= impls
    assert {r["config"]["H"] for r in measured} == {64, 256}
    for r in measured:
        assert r["config"]["timing"] == "eager"  # the CPU default
        m = r["metrics"]
        assert m["fwd_ms"] > 0 and m["fwdbwd_ms"] > 0 and m["fwd_pct"] > 0
        assert m["rel_err"] < 1e-5
        assert r["env"]["device"] == "cpu"
    assert (out / "norm.md").read_text().startswith("# RMSNorm")
    assert (out / "norm_fwdbwd_float32.png").read_bytes()[:4] == b"\x89PNG"


def test_norm_graph_timing_needs_cuda():
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        main(["norm", "--quick", "--timing", "graph"])


@pytest.mark.triton
def test_norm_quick_runs_the_triton_kernels(tmp_path, monkeypatch):
    """In the triton-interpret session: tritonnorm's Triton kernels in the norm suite."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (nox -s triton-interpret)")
    pytest.importorskip("tritonnorm")
    out = tmp_path / "out"
    code = main(["norm", "--quick", "--out", str(out), "--impl", "tritonnorm,torch-naive",
                 "--hidden", "64", "--rows", "8", "--repeats", "1", "--warmup", "0"])
    assert code == 0
    rows = [r for r in read_records(out / "norm.jsonl") if r["config"]["impl"] == "tritonnorm"]
    assert rows and rows[0]["metrics"]["status"] == "ok", rows
    assert rows[0]["metrics"]["rel_err"] < 1e-5
    assert rows[0]["metrics"]["fwdbwd_vs_best"] > 0
