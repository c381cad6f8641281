"""Which rank owns which parameter: greedy largest-first onto the least-loaded rank.

This is a pure function of sizes, so every rank computes the same answer without
talking to the others, and it can be tested without a process group.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def partition_parameters(
    sizes: Sequence[int], world_size: int, loads: Sequence[int] | None = None
) -> tuple[list[int], list[int]]:
    """Assign whole parameters to ranks, balancing the total size each rank owns.

    Parameters are taken largest first (ties: the earlier one first) and each goes to
    the rank with the smallest load so far (ties: the lower rank). Passing the loads a
    previous call returned continues the balance, which is how later parameter groups
    and ``add_param_group`` keep the whole model balanced rather than each group alone.

    Because a parameter always lands on a rank whose load is at most the mean of what
    has been placed, no rank ends above ``sum(sizes) / world_size + max(sizes)`` (plus
    the imbalance already present in ``loads``).

    Args:
        sizes: one non-negative size per parameter (bytes or elements), in group order.
        world_size: number of ranks, at least 1.
        loads: each rank's load before this call; zeros when omitted.

    Returns:
        ``(owners, loads)``: the owning rank of each parameter, in the order of
        ``sizes``, and each rank's load afterwards.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    start = [0] * world_size if loads is None else [int(x) for x in loads]
    if len(start) != world_size:
        raise ValueError(f"loads has {len(start)} entries for world_size {world_size}")
    if any(s < 0 for s in sizes):
        raise ValueError(f"sizes must be non-negative, got {list(sizes)}")

    # A heap of (load, rank) pops the least-loaded rank, the lowest rank among equals.
    heap = [(load, rank) for rank, load in enumerate(start)]
    heapq.heapify(heap)
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, rank = heapq.heappop(heap)
        owners[index] = rank
        start[rank] = load + sizes[index]
        heapq.heappush(heap, (start[rank], rank))
    return owners, start
