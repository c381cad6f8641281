"""``lab2bench --help``, ``lab2bench comm --help`` and ``--version`` answer without importing
torch."""

from __future__ import annotations

import importlib.metadata

import pytest

from lab2_testing.cli import run_main


@pytest.mark.parametrize("argv", [["--help"], ["comm", "--help"]])
def test_help_imports_no_torch(argv):
    run = run_main("lab2bench.cli", argv)
    assert run.code in (0, None), run
    assert run.slow_imports == [], f"lab2bench {' '.join(argv)} imported {run.slow_imports}"
    assert "usage: lab2bench" in run.out and "comm" in run.out


def test_version():
    run = run_main("lab2bench.cli", ["--version"])
    assert run.code == 0 and run.slow_imports == []
    assert run.out.strip() == f"lab2bench {importlib.metadata.version('lab2bench')}"
