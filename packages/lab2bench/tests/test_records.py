"""Recorder, read_records, markdown_table, plot_sweep, env_info."""

from __future__ import annotations

import json
import math

import pytest
import torch

import lab2bench
from lab2bench import Recorder, markdown_table, plot_sweep, read_records


def test_recorder_lines_parse_back(tmp_path):
    path = tmp_path / "sub" / "bench.jsonl"
    rec = Recorder(path)
    stats = lab2bench.Stats.from_samples([0.001, 0.002])
    first = rec.record("norm", {"dtype": torch.bfloat16, "H": 1024, "device": torch.device("cpu")},
                       {"median_ms": 1.5, "stats": stats, "nan": math.nan,
                        "tensor": torch.tensor([1.0, 2.0]), "scalar": torch.tensor(3)})
    rec.record("comm", {"world_size": 2}, {"busbw_gbps": 3.25})
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    back = read_records(path)
    assert back[0] == first
    assert back[0]["config"] == {"dtype": "torch.bfloat16", "H": 1024, "device": "cpu"}
    assert back[0]["metrics"]["median_ms"] == 1.5
    assert back[0]["metrics"]["stats"]["n"] == 2
    assert back[0]["metrics"]["nan"] is None
    assert back[0]["metrics"]["tensor"] == [1.0, 2.0] and back[0]["metrics"]["scalar"] == 3
    for r in back:
        assert r["run_id"] == rec.run_id
        assert r["timestamp"].endswith("Z")
        env = r["env"]
        assert torch.__version__.startswith(env["versions"]["torch"].split("+")[0])
        assert env["cpu_count"] >= 1 and env["hostname"]
        assert "git" in env and "device_name" in env
    assert [r["suite"] for r in read_records(path, suite="comm")] == ["comm"]

    # A second run appends.
    rec2 = Recorder(path)
    rec2.record("norm", {"H": 1}, {"x": 1})
    assert len(read_records(path)) == 3
    assert len(read_records(path, run_id=rec2.run_id)) == 1


def test_read_records_truncated_last_line_and_bad_line(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"suite": "a"}\n{"suite": "b"\n')
    with pytest.warns(UserWarning, match="incomplete"):
        assert read_records(path) == [{"suite": "a"}]
    path.write_text('{"suite": "a"\n{"suite": "b"}\n')
    with pytest.raises(ValueError, match="line 1"):
        read_records(path)


def test_recorder_rejects_bad_input(tmp_path):
    rec = Recorder(tmp_path / "x.jsonl", env={"fake": True})
    with pytest.raises(ValueError, match="suite"):
        rec.record("", {}, {})
    with pytest.raises(TypeError, match="dicts"):
        rec.record("s", [], {})
    assert rec.record("s", {}, {})["env"] == {"fake": True}


def test_env_info_fields():
    info = lab2bench.env_info("cpu")
    assert info["device"] == "cpu"
    assert info["versions"]["python"].count(".") == 2
    json.dumps(info)


def test_markdown_table_formatting():
    rows = [
        {"impl": "a|b", "H": 1024, "ms": 0.123456, "ok": True},
        {"impl": "c", "H": 2048, "ms": None},
        {"impl": "d", "H": 4096, "ms": 12.0, "extra": "x"},
    ]
    text = markdown_table(rows, ["impl", "H", "ms", "ok"], floatfmt={"ms": ".2f"},
                          headers={"ms": "time ms"})
    assert text == (
        "| impl | H | time ms | ok |\n"
        "|---|---:|---:|---|\n"
        "| a\\|b | 1024 | 0.12 | True |\n"
        "| c | 2048 |  |  |\n"
        "| d | 4096 | 12.00 |  |\n"
    )
    auto = markdown_table(rows)
    assert auto.splitlines()[0] == "| impl | H | ms | ok | extra |"
    assert markdown_table([{"v": 1234.5678}], floatfmt=".3g").splitlines()[2] == "| 1.23e+03 |"
    with pytest.raises(ValueError, match="no columns"):
        markdown_table([])


def test_plot_sweep_writes_png(tmp_path):
    rows = [{"size": s, "bw": s / 1e3 * (k + 1), "backend": b, "ws": k}
            for k, b in enumerate(["gloo", "nccl"]) for s in (1024, 4096, 65536)]
    rows.append({"size": None, "bw": 1.0, "backend": "gloo", "ws": 0})  # left out
    path = plot_sweep(rows, x="size", y="bw", series=("backend", "ws"), logx=True,
                      path=tmp_path / "plots" / "bw.png", title="t")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    with pytest.raises(ValueError, match="no row"):
        plot_sweep(rows, x="nope", y="bw", series=None, path=tmp_path / "n.png")


def test_progress_passes_items_through():
    assert list(lab2bench.progress(range(4), description="x", disable=True)) == [0, 1, 2, 3]
    assert list(lab2bench.progress(iter("ab"))) == ["a", "b"]


def test_atomic_writes_are_lab2sys_under_lab2bench_names(tmp_path):
    # Their behaviour is tested in packages/lab2sys/tests; here, that the names still work.
    import lab2sys.files
    from lab2bench import records

    for name in ("atomic_write", "atomic_write_bytes", "atomic_write_text"):
        assert getattr(lab2bench, name) is getattr(lab2sys.files, name)
    assert records.temp_file_beside is lab2sys.files.temp_file_beside
    p = lab2bench.atomic_write_text(tmp_path / "a.txt", "one")
    lab2bench.atomic_write_text(p, "two")
    assert p.read_text() == "two"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["a.txt"]
