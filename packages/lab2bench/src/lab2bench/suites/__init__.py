"""The suites of the ``lab2bench`` command, and how other packages add theirs.

Built in: ``comm``. Another installed package adds a suite by declaring an entry point in
the group ``lab2bench.suites`` that names a ``Suite`` (or a zero-argument callable returning
one)::

    [project.entry-points."lab2bench.suites"]
    norm = "tritonnorm.bench:norm_suite"

(tritonnorm[bench] adds ``norm`` and ``norm-host`` so; lab2-trainer its ``train-*`` suites),
or, in-process, with ``register_suite(suite)`` before ``lab2bench.cli.main()``. The module
an entry point names is imported for ``lab2bench --help``: it must not import torch.
"""

from __future__ import annotations

import importlib.metadata
import warnings

from lab2bench.suites.base import Suite
from lab2bench.suites.output import SuiteOutput

ENTRY_POINT_GROUP = "lab2bench.suites"
_registered: dict[str, Suite] = {}


def register_suite(suite: Suite) -> None:
    """Make ``suite`` available to the ``lab2bench`` command in this process."""
    if not isinstance(suite, Suite):
        raise TypeError(f"expected a lab2bench.suites.Suite, got {type(suite).__name__}")
    _registered[suite.name] = suite


def _entry_point_suites() -> dict[str, Suite]:
    found: dict[str, Suite] = {}
    try:
        eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    except TypeError:  # Python < 3.10 signature; kept for safety
        eps = importlib.metadata.entry_points().get(ENTRY_POINT_GROUP, [])  # type: ignore
    for ep in eps:
        try:
            obj = ep.load()
            suite = obj() if callable(obj) and not isinstance(obj, Suite) else obj
            if not isinstance(suite, Suite):
                raise TypeError(f"{ep.value} is not a lab2bench Suite")
        except Exception as err:  # a broken plug-in must not break the built-in suites
            warnings.warn(f"lab2bench: suite entry point {ep.name!r} failed to load: {err}",
                          RuntimeWarning, stacklevel=2)
            continue
        found[suite.name] = suite
    return found


def available_suites() -> dict[str, Suite]:
    """Every suite by name: built-in, then entry points, then registered in-process."""
    from lab2bench.suites import comm

    suites = {comm.SUITE.name: comm.SUITE}
    for name, suite in {**_entry_point_suites(), **_registered}.items():
        suites.setdefault(name, suite)
    return suites


__all__ = ["ENTRY_POINT_GROUP", "Suite", "SuiteOutput", "available_suites", "register_suite"]
