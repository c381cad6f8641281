"""Fixtures shared by the trainer's tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from lab2_trainer.data.corpus import stdlib_root


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    """A small real corpus: the first 30 top-level modules of the standard library."""
    root = tmp_path_factory.mktemp("corpus")
    for path in sorted(stdlib_root().glob("*.py"))[:30]:
        shutil.copy(path, root / path.name)
    return root


@pytest.fixture
def disk_full_at(monkeypatch):
    """``disk_full_at(step)``: the checkpoint writes of that step's folder fail as on a full
    disk (``OSError`` 28, from ``write_parts``); every other save writes as usual."""
    from lab2_trainer.checkpoint import writer as checkpoint_writer
    from lab2_trainer.checkpoint.folders import step_folder

    real_write = checkpoint_writer.write_parts

    def fail_at(step: int) -> None:
        name = step_folder("", step).name

        def write_parts(parts, writer, group):
            if name in str(writer.path):
                raise OSError(28, "No space left on device")
            return real_write(parts, writer, group)

        monkeypatch.setattr(checkpoint_writer, "write_parts", write_parts)

    return fail_at
