"""The multi-GPU table script (benchmarks/multi_gpu.py): its launches and tables, and one
real CPU smoke run of the stack and scaling tables on Gloo ranks."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "multi_gpu.py"


def _module():
    spec = importlib.util.spec_from_file_location("multi_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_table_gets_its_launches():
    m = _module()
    args = m.parse_args(["--out", "x", "--world-sizes", "2,4", "--presets", "small,xl",
                         "--batch-sizes", "8,32"])
    runs = m.suite_runs(args)
    by_table = {t: [a for table, a in runs if table == t] for t in m.TABLES}
    # ddp: two bucket rules per cell; zero: one per cell; stack: world sizes 1, 2, 4.
    assert len(by_table["ddp"]) == 2 * 2 * 2 * 2
    assert len(by_table["zero"]) == 2 * 2 * 2
    assert sorted({a[a.index("--world-size") + 1] for a in by_table["stack"]}) == ["1", "2", "4"]
    assert all("--compile" in a for a in by_table["stack"])
    with pytest.raises(SystemExit):
        m.parse_args(["--out", "x", "--tables", "bogus"])


def test_scaling_is_per_gpu_over_one_gpu():
    m = _module()
    rec = lambda n, tps: {"config": {"preset": "xl", "batch_size": 8, "variant": "ours",  # noqa: E731
                                     "world_size": n}, "metrics": {"tokens_per_s": tps},
                          "command": f"ws{n}"}
    rows = m.scaling_rows([rec(1, 100.0), rec(2, 190.0)])
    assert rows[1]["tokens_per_s_per_gpu"] == 95.0
    assert rows[1]["scaling_efficiency"] == pytest.approx(0.95)
    md = m.markdown("scaling", rows)
    assert "| xl | 8 | ours | 2 | 95 | 0.95 |" in md and "ws2" in md


@pytest.mark.slow
def test_cpu_smoke_run_writes_the_tables(tmp_path):
    m = _module()
    assert m.main(["--quick", "--world-sizes", "2", "--tables", "stack,scaling",
                   "--out", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "scaling.jsonl").read_text().splitlines()]
    assert {r["world_size"] for r in rows} == {1, 2}
    assert all(r["scaling_efficiency"] > 0 for r in rows)
    assert "apps/trainer/benchmarks/stack.py" in (tmp_path / "stack.md").read_text()
