"""tritonnorm's benchmark suites for the ``lab2bench`` command: ``norm`` (RMSNorm
implementations side by side) and ``norm-host`` (the host cost of one call).

They need lab2bench: ``pip install tritonnorm[bench]``. tritonnorm declares them as entry
points of the group ``lab2bench.suites``; the functions below import the suites' modules
(and so lab2bench) only when lab2bench asks for them, so tritonnorm alone never imports
lab2bench.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lab2bench.suites import Suite


def norm_suite() -> Suite:
    """The ``norm`` suite (entry point ``norm`` of ``lab2bench.suites``)."""
    from tritonnorm.bench.norm import SUITE

    return SUITE


def norm_host_suite() -> Suite:
    """The ``norm-host`` suite (entry point ``norm-host`` of ``lab2bench.suites``)."""
    from tritonnorm.bench.norm_host import SUITE

    return SUITE


__all__ = ["norm_suite", "norm_host_suite"]
