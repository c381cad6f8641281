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
        m = r["metrics"]
        assert m["fwd_ms"] > 0 and m["fwdbwd_ms"] > 0 and m["fwd_pct"] > 0
        assert m["rel_err"] < 1e-5
        assert r["env"]["device"] == "cpu"
    assert (out / "norm.md").read_text().startswith("# RMSNorm")
    assert (out / "norm_fwdbwd_float32.png").read_bytes()[:4] == b"\x89PNG"


def test_comm_quick(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["comm", "--quick", "--out", str(out), "--sizes", "4KB,64KB",
                 "--repeats", "3", "--timeout", "60"])
    assert code == 0
    assert "busbw GB/s" in capsys.readouterr().out
    records = read_records(out / "comm.jsonl", suite="comm")
    assert [r["config"]["size_bytes"] for r in records] == [4096, 65536]
    for r in records:
        assert r["config"]["backend"] == "gloo" and r["config"]["world_size"] == 2
        assert r["metrics"]["status"] == "ok"
        assert r["metrics"]["time_ms"] > 0 and r["metrics"]["busbw_gbps"] > 0
    assert (out / "comm_busbw.png").exists() and (out / "comm.md").exists()
