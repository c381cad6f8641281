"""``lab2-train --help``, ``lab2-train bench --help`` and ``--version`` answer without
importing torch."""

from __future__ import annotations

import importlib.metadata

import pytest

from lab2_testing.cli import run_main
from lab2_trainer.bench.cli import SUITES, suite_module


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"], ["bench"]])
def test_help_imports_no_torch(argv):
    run = run_main("lab2_trainer.cli", argv)
    assert run.slow_imports == [], f"lab2-train {' '.join(argv)} imported {run.slow_imports}"
    assert run.code == (0 if "--help" in argv else 2), run
    if argv[0] == "bench" and "--help" in argv:
        assert all(name in run.out for name in SUITES)


@pytest.mark.parametrize("argv", [["--version"], ["bench", "--version"]])
def test_version(argv):
    run = run_main("lab2_trainer.cli", argv)
    assert run.code == 0 and run.slow_imports == []
    assert run.out.strip() == f"lab2-train {importlib.metadata.version('lab2-trainer')}"


@pytest.mark.parametrize("name", list(SUITES))
def test_suite_help_imports_no_torch(name):
    """A suite's options come from ``bench.arguments``: its ``--help`` (the common options
    and its own) imports neither torch nor the module that runs it."""
    run = run_main("lab2_trainer.cli", ["bench", name, "--help"])
    assert run.code == 0, run
    assert run.slow_imports == [], f"lab2-train bench {name} --help imported {run.slow_imports}"
    assert f"usage: lab2-train bench {name}" in run.out and "common options" in run.out
    assert SUITES[name].help in " ".join(run.out.split())  # argparse wraps the description


@pytest.mark.parametrize("name", list(SUITES))
def test_lab2bench_suite_help_imports_no_torch(name):
    run = run_main("lab2bench.cli", [f"train-{name}", "--help"])
    assert run.code == 0, run
    assert run.slow_imports == [], f"lab2bench train-{name} --help imported {run.slow_imports}"
    assert f"usage: lab2bench train-{name}" in run.out and "--preset" in run.out
    assert ("--world-size" in run.out) == (name in ("ddp", "zero", "stack"))


@pytest.mark.parametrize("name", list(SUITES))
def test_every_suite_has_a_module_that_runs_it(name):
    assert callable(suite_module(name).run)


def test_lab2bench_lists_the_trainer_suites_without_torch():
    """The trainer's suites reach ``lab2bench`` through entry points; listing them (which
    imports the modules the entry points name) imports no torch."""
    run = run_main("lab2bench.cli", ["--help"])
    assert run.code == 0 and run.slow_imports == [], run
    assert all(f"train-{name}" in run.out for name in SUITES)


def test_the_runtime_imports_no_benchmark_package():
    """Training, launching and planning take nothing from ``lab2bench`` (only the ``bench``
    subpackage does)."""
    import subprocess
    import sys
    from pathlib import Path

    import lab2_trainer

    root = Path(lab2_trainer.__file__).parent
    names = sorted(f"lab2_trainer.{p.stem}" for p in root.glob("*.py") if p.stem != "__init__")
    code = ("import sys\n" + "".join(f"import {n}\n" for n in names)
            + "print(sorted(m for m in sys.modules if m.split('.')[0] == 'lab2bench'))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", run.stdout
