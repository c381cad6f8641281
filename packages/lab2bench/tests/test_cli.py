"""Smoke runs of every suite's --quick form, in-process, and the CLI's plumbing."""

from __future__ import annotations

import pytest

from lab2bench import read_records
from lab2bench.cli import main


def test_list_shows_suites(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "norm" in out and "comm" in out


def test_no_command_prints_help(capsys):
    assert main([]) == 2


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


def test_comm_quick(world_size, tmp_path, capsys):
    """A Gloo test (it takes ``world_size``): the quick sweep at this cell's world size."""
    out = tmp_path / "out"
    code = main(["comm", "--quick", "--out", str(out), "--sizes", "4KB,64KB",
                 "--world-sizes", str(world_size), "--repeats", "3", "--timeout", "60"])
    assert code == 0
    assert "busbw GB/s" in capsys.readouterr().out
    records = read_records(out / "comm.jsonl", suite="comm")
    assert [r["config"]["size_bytes"] for r in records] == [4096, 65536]
    for r in records:
        assert r["config"]["backend"] == "gloo" and r["config"]["device"] == "cpu"
        assert r["config"]["world_size"] == world_size
        m = r["metrics"]
        assert m["status"] == "ok" and m["time_ms"] > 0 and m["algbw_gbps"] > 0
        assert m["busbw_gbps"] == pytest.approx(
            m["algbw_gbps"] * 2 * (world_size - 1) / world_size)
    assert (out / "comm_busbw.png").exists() and (out / "comm.md").exists()


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


def test_registered_suite_runs_with_common_options(tmp_path, capsys, monkeypatch):
    import lab2bench
    import lab2bench.suites

    monkeypatch.setattr(lab2bench.suites, "_registered", {})  # leave no suite behind
    seen = {}

    def add_arguments(parser):
        parser.add_argument("--size", type=int, default=3)

    def run(args):
        seen.update(quick=args.quick, out=args.out, device=args.device, size=args.size)
        return 0

    lab2bench.register_suite(lab2bench.Suite("fake-suite", "a suite for tests", add_arguments, run))
    assert main(["list"]) == 0
    assert "fake-suite" in capsys.readouterr().out
    assert main(["fake-suite", "--quick", "--out", str(tmp_path), "--size", "7"]) == 0
    assert seen == {"quick": True, "out": str(tmp_path), "device": None, "size": 7}
    with pytest.raises(TypeError, match="Suite"):
        lab2bench.register_suite(object())
