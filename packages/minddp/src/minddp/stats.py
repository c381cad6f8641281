"""Timing counters a wrapper fills in on every ``finish_gradient_synchronization``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SyncStats:
    """What the last ``finish_gradient_synchronization`` call cost.

    Benchmarks read these to compute how much communication stayed exposed after
    backward (``wait_seconds``, or ``finish_seconds`` including the bookkeeping).

    Attributes:
        finish_seconds: wall time of the whole ``finish_gradient_synchronization`` call.
        wait_seconds: part of it spent blocked on outstanding collectives.
        launched_in_backward: collectives started by gradient hooks during backward.
        launched_in_finish: collectives that had to wait until the finish call
            (unused parameters, or hooks that fired out of the fixed order).
    """

    finish_seconds: float = 0.0
    wait_seconds: float = 0.0
    launched_in_backward: int = 0
    launched_in_finish: int = 0
