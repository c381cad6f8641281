"""Load a helper module that sits beside a test file.

pytest's ``importlib`` import mode keeps test folders off ``sys.path``, so a test cannot
``import`` the helper next to it. ``load_sibling(__file__, "helpers.py", "_pkg_helpers")``
loads it by path once per process, under a name unique to the package, and returns it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_sibling(anchor_file: str, filename: str, module_name: str) -> ModuleType:
    """The module ``filename`` in ``anchor_file``'s folder, loaded once as ``module_name``."""
    return load_path(Path(anchor_file).with_name(filename), module_name)


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
