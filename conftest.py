"""Shared pytest setup for every member's tests.

* Hypothesis profiles: ``dev`` (quick, the default on a workstation) and ``ci``
  (thorough). ``LAB2_HYPOTHESIS_PROFILE`` picks one; when it is unset, ``CI`` being
  set picks ``ci``. Our ``ci`` replaces Hypothesis's built-in profile of that name,
  which it would otherwise load by itself when ``CI`` is set.
* ``world_size``: a test that takes this fixture is a Gloo test. It gets the
  ``gloo`` marker and runs once per world size in ``LAB2_WORLD_SIZES``
  (comma-separated, default ``1,2,3,4``), which is how ``nox -s "tests-gloo(world_size=3)"``
  runs one cell of the matrix alone.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile(
    "dev", max_examples=8, deadline=None, suppress_health_check=_SLOW_OK, print_blob=True
)
settings.register_profile(
    "ci", max_examples=25, deadline=None, suppress_health_check=_SLOW_OK, print_blob=True
)
_default_profile = "ci" if os.environ.get("CI") else "dev"
settings.load_profile(os.environ.get("LAB2_HYPOTHESIS_PROFILE", _default_profile))


def _world_sizes() -> list[int]:
    raw = os.environ.get("LAB2_WORLD_SIZES", "1,2,3,4")
    sizes = [int(s) for s in raw.split(",") if s.strip()]
    if not sizes or any(s < 1 for s in sizes):
        raise pytest.UsageError(f"LAB2_WORLD_SIZES must list positive integers, got {raw!r}")
    return sizes


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "world_size" in metafunc.fixturenames:
        metafunc.parametrize("world_size", _world_sizes(), ids=lambda n: f"ws{n}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "world_size" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.gloo)
