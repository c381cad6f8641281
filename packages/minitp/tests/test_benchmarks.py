"""minitp's benchmark scripts (``benchmarks/``) in their ``--quick`` form on the CPU, each
in a fresh interpreter (their ranks find the rank function in the script run as
``__main__``). No timing is asserted: only that they run and print their tables, and that
the memory benchmark's measured peaks are its analytic ones (the gathered path's up to
the all-gather's buffers, which the backend may free late)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

pytestmark = pytest.mark.slow  # each spawns two Gloo ranks: 15-40 s on 2 busy cores


def _run(script: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _table(out: str) -> list[list[str]]:
    lines = [line for line in out.splitlines() if line.startswith("|")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]


def test_overlap_quick():
    out = _run("overlap.py", "--quick")
    assert "| variant | ms per call | ratio to overlap | range |" in out
    rows = _table(out)
    assert [r[0] for r in rows] == ["overlap", "no overlap", "overlap (A/A)"]
    assert rows[0][2] == "1.000" and all(float(r[1]) > 0 for r in rows)


def test_vocab_ce_memory_quick():
    out = _run("vocab_ce_memory.py", "--quick")
    rows = _table(out)
    assert [r[0] for r in rows] == ["32768", "65536", "131072"]
    for _, measured, analytic, gathered, gathered_analytic, _ratio in rows:
        assert measured == analytic, rows
        # The gathered path may measure the all-gather's buffers too (N·V·s·(1 + 1/tp)),
        # when the backend frees a finished collective late.
        slack = float(gathered_analytic) / 3 * 1.5
        assert 0 <= float(gathered) - float(gathered_analytic) <= slack, rows


def test_host_time_quick():
    out = _run("host_time.py", "--quick")
    assert "| kind | variant | us to issue | us per call |" in out
    rows = _table(out)
    assert [(r[0], r[1]) for r in rows[:3]] == [
        ("all-reduce", "torch.distributed"), ("all-reduce", "functional"),
        ("all-reduce", "torch.distributed (A/A)")]
    assert {r[0] for r in rows} == {"all-reduce", "all-gather", "reduce-scatter", "dropout"}
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)
