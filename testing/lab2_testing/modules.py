"""Load a module by its file path, once per process.

``run_ranks`` (``lab2_testing.dist``) finds a rank function again in each spawned rank
by the file it is defined in: that also works for test modules, which pytest's
``importlib`` import mode does not make importable by name.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_path(path: str | Path, module_name: str) -> ModuleType:
    """The module at ``path``, loaded once per process as ``module_name``."""
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return module
