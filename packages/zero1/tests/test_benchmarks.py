"""zero1's benchmark scripts in their quick form on the CPU, run in this process (their
``main(argv)``). Benchmarks are not tests: nothing here asserts a time."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from lab2bench import read_records

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def script(name: str):
    spec = importlib.util.spec_from_file_location(f"zero1_benchmarks_{name}",
                                                  BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_muon_quick(tmp_path, capsys):
    out = tmp_path / "muon.jsonl"
    assert script("muon").main(["--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| muon |" in printed and "| adamw#2 |" in printed
    records = read_records(out, suite="zero1-muon-step")
    assert [r["metrics"]["variant"] for r in records] == ["adamw", "adamw#2", "muon",
                                                           "muon-fp32"]
    for r in records:
        assert math.isfinite(r["metrics"]["median_ms"]) and r["metrics"]["median_ms"] > 0
    assert records[0]["metrics"]["ratio"] == 1.0  # the baseline against itself
    assert records[2]["metrics"]["ns_gflop"] > 0


def test_muon_flop_count_and_shapes():
    muon = script("muon")
    assert muon.layer_shapes(8, 2) == [(8, 8)] * 4 + [(32, 8), (8, 32)] + [(8, 8)] * 4 + [
        (32, 8), (8, 32)]
    # One 2 x 3 matrix, 5 steps: 5 * (4*2*2*3 + 2*2**3) = 5 * 64.
    assert muon.ns_flops([(3, 2)]) == muon.ns_flops([(2, 3)]) == 320


@pytest.mark.parametrize("argv", [["--width", "0"], ["--device", "tpu"],
                                  ["--world-sizes", "two"], ["--world-sizes", "0"]])
def test_muon_bad_options_are_usage_errors(argv):
    with pytest.raises(SystemExit) as exc:
        script("muon").main(argv)
    assert exc.value.code == 2
