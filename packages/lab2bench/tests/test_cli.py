"""``lab2bench comm``, in-process: its quick sweep and the CLI's plumbing."""

from __future__ import annotations

import pytest

from lab2bench import read_records
from lab2bench.cli import main


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


def test_bad_option_exits_with_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["comm", "--sizes", "abc"])
    assert info.value.code == 2 and "not a size" in capsys.readouterr().err
