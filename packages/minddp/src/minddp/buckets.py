"""The bucket plan: which parameters share a bucket. Pure logic, no communication, and
no torch import (a command line reads :data:`BUCKET_RULES` for its ``--help`` quickly).

:class:`~minddp.DDPBucketed` cuts its buckets with :func:`assign_buckets`, and so does
zero1 (its stages 1 and 2); the validators check the two bucket options a command line
offers.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["BUCKET_RULES", "TensorInfo", "assign_buckets", "validate_bucket_rule",
           "validate_bucket_size_mb"]

#: How a cap cuts buckets: "at_most" never lets a bucket pass the cap (a parameter that
#: would push it past opens the next one); "reach" closes a bucket once it reaches the
#: cap, so each holds at least the cap but the last of a group, up to one parameter over
#: it (PyTorch DDP's rule, which makes about half as many buckets).
BUCKET_RULES = ("at_most", "reach")

_MIB = 1024 * 1024




@dataclass(frozen=True)
class TensorInfo:
    """What bucketing needs to know about one parameter.

    Attributes:
        numel: number of elements.
        element_size: bytes per element.
        group: tensors of different groups (dtype and device) never share a bucket.
    """

    numel: int
    element_size: int
    group: Hashable


def validate_bucket_size_mb(bucket_size_mb: float | None) -> float | None:
    """Return ``bucket_size_mb`` if it is None or a finite positive number, else raise."""
    if bucket_size_mb is None:
        return None
    if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, (int, float)):
        raise TypeError(f"bucket_size_mb must be a number or None, got {bucket_size_mb!r}")
    if not (math.isfinite(bucket_size_mb) and bucket_size_mb > 0):
        raise ValueError(f"bucket_size_mb must be positive and finite, got {bucket_size_mb}")
    return float(bucket_size_mb)


def validate_bucket_rule(rule: str) -> str:
    """Return ``rule`` if it is one of :data:`BUCKET_RULES`, else raise ``ValueError``."""
    if rule not in BUCKET_RULES:
        raise ValueError(f"bucket_rule must be one of {', '.join(BUCKET_RULES)}, got {rule!r}")
    return rule


def assign_buckets(
    infos: Sequence[TensorInfo],
    bucket_size_mb: float | None,
    order: Sequence[int] | None = None,
    rule: str = "at_most",
) -> list[list[int]]:
    """Group parameter indices into buckets, walking the parameters in ``order``.

    ``order`` is the order gradients are expected in. By default it is reverse
    registration order (backward roughly reverses forward), so the first bucket is
    the first to fill.

    Rules: a bucket holds one group only (dtype/device); with ``rule="at_most"``
    adding a parameter that would push a bucket past ``bucket_size_mb`` MiB closes it
    and opens a new one, so a parameter larger than the cap sits alone; with
    ``rule="reach"`` a bucket closes as soon as it holds ``bucket_size_mb`` MiB or
    more; None means no cap (one bucket per group).

    Args:
        infos: one entry per parameter, in registration order.
        bucket_size_mb: cap per bucket in MiB (2**20 bytes), or None.
        order: a permutation of ``range(len(infos))``; None: reverse registration order.
        rule: "at_most" or "reach" (:data:`BUCKET_RULES`).

    Returns:
        Buckets of indices into ``infos``, each listed in ``order``, the buckets sorted
        by where their first member comes in ``order``.
    """
    cap = validate_bucket_size_mb(bucket_size_mb)
    reach = validate_bucket_rule(rule) == "reach"
    cap_bytes = None if cap is None else cap * _MIB
    if order is None:
        order = list(reversed(range(len(infos))))
    elif sorted(order) != list(range(len(infos))):
        raise ValueError(f"order must be a permutation of range({len(infos)}), got {order}")
    position = {index: pos for pos, index in enumerate(order)}
    open_bucket: dict[Hashable, tuple[list[int], int]] = {}
    closed: list[list[int]] = []
    for i in order:
        info = infos[i]
        nbytes = info.numel * info.element_size
        members, size = open_bucket.get(info.group, ([], 0))
        if not reach and members and cap_bytes is not None and size + nbytes > cap_bytes:
            closed.append(members)
            members, size = [], 0
        members.append(i)
        size += nbytes
        if reach and cap_bytes is not None and size >= cap_bytes:
            closed.append(members)
            members, size = [], 0
        open_bucket[info.group] = (members, size)
    closed.extend(members for members, _ in open_bucket.values() if members)
    closed.sort(key=lambda members: position[members[0]])
    return closed
