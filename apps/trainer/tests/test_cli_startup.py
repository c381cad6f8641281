"""``lab2-train --help`` and ``--version`` answer without importing torch."""

from __future__ import annotations

import importlib.metadata

from lab2_testing.cli import run_main


def test_help_imports_no_torch():
    run = run_main("lab2_trainer.cli.main", ["--help"])
    assert run.slow_imports == [], f"lab2-train --help imported {run.slow_imports}"
    assert run.code == 0, run


def test_version():
    run = run_main("lab2_trainer.cli.main", ["--version"])
    assert run.code == 0 and run.slow_imports == []
    assert run.out.strip() == f"lab2-train {importlib.metadata.version('lab2-trainer')}"


def test_the_runtime_imports_no_benchmark_package():
    """Training, launching and planning take nothing from ``lab2bench`` (the benchmark
    scripts under ``apps/trainer/benchmarks`` do): the file and process helpers the two share
    are ``lab2sys``'s, which imports the standard library alone."""
    import subprocess
    import sys
    from pathlib import Path

    import lab2_trainer

    root = Path(lab2_trainer.__file__).parent
    names = sorted("lab2_trainer." + ".".join(p.relative_to(root).with_suffix("").parts)
                   for p in root.rglob("*.py") if p.stem not in ("__init__", "__main__"))
    code = ("import sys\n" + "".join(f"import {n}\n" for n in names)
            + "print(sorted(m for m in sys.modules if m.split('.')[0] == 'lab2bench'))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", run.stdout
    shared = subprocess.run(
        [sys.executable, "-c", "import sys; before = set(sys.modules); "
         "import lab2sys.files, lab2sys.processes; "
         "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in "
         "('torch', 'numpy', 'rich', 'matplotlib', 'psutil')))"],
        capture_output=True, text=True, timeout=300)
    assert shared.returncode == 0 and shared.stdout.strip() == "[]", shared


def test_the_training_loop_imports_no_checkpoint_machinery():
    """A run's start-up leaves ``torch.distributed.checkpoint`` to its first save or load:
    importing the training loop does not import it."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", "import sys; import lab2_trainer.training.loop; "
         "print(sorted(m for m in sys.modules if m.startswith("
         "('torch.distributed.checkpoint', 'lab2_trainer.checkpoint.planners'))))"],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", run.stdout
