"""The ranges of tritonnorm's arguments, in plain Python: code that checks its settings
before torch is imported (a command line, whose ``--help`` must stay quick) checks them
with the same definition as the norms.

``import tritonnorm.limits`` imports neither torch nor triton (``tritonnorm/__init__.py``
imports its exports on first use).
"""

from __future__ import annotations

import math
import numbers

#: The range of ``eps``, as the end of an error's sentence ("eps must be ...").
EPS_RANGE = "a finite number >= 0"


def eps_in_range(eps: float) -> bool:
    """Whether the number ``eps`` is finite and >= 0 (NaN is not)."""
    return eps >= 0.0 and eps != math.inf


def check_eps(eps: float) -> float:
    """Return ``eps`` as a float: TypeError unless it is a real number (a string, a bool or
    a tensor is not), ValueError unless it is finite and >= 0."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a real number, got {type(eps).__name__} {eps!r}")
    eps = float(eps)
    if not eps_in_range(eps):
        raise ValueError(f"eps must be {EPS_RANGE}, got {eps}")
    return eps
