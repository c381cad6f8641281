"""Smoke runs of every suite's --quick form, in-process, and the CLI's plumbing."""

from __future__ import annotations

import pytest

from lab2bench import read_records
from lab2bench.cli import main


def test_list_shows_suites(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "comm" in out


def test_no_command_prints_help(capsys):
    assert main([]) == 2


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
