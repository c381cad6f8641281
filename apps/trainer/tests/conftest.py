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
