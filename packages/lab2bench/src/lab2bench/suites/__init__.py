"""The suites of the ``lab2bench`` command, and how other packages add theirs.

Built in: ``norm``, ``norm-host`` and ``comm``. Another installed package adds a suite by
declaring an entry point in the group ``lab2bench.suites`` that names a ``Suite``
(or a zero-argument callable returning one)::

    [project.entry-points."lab2bench.suites"]
    train = "lab2_trainer.bench:SUITE"

or, in-process, with ``register_suite(suite)`` before ``lab2bench.cli.main()``.
"""

from __future__ import annotations

import importlib.metadata
import warnings

from lab2bench.suites.base import Suite

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
    from lab2bench.suites import comm, norm, norm_host

    suites = {s.name: s for s in (norm.SUITE, norm_host.SUITE, comm.SUITE)}
    for name, suite in {**_entry_point_suites(), **_registered}.items():
        suites.setdefault(name, suite)
    return suites


__all__ = ["ENTRY_POINT_GROUP", "Suite", "available_suites", "register_suite"]
