"""Agree, once, on the order in which gradients are expected.

Both overlapping wrappers launch collectives only along a fixed order, the same
on every rank. They start with reverse registration order; after the first
synchronized step they switch to the order rank 0 actually saw its gradients
arrive in, so a model whose backward does not reverse its registration order (or
whose last-registered parameter is unused) still overlaps communication from the
second step on. Rank 0's observation is broadcast, so every rank adopts the same
order even when their backward passes differed.
"""

from __future__ import annotations

import torch.distributed as dist

from minddp._group import global_rank_of, group_size


def agree_on_order(
    observed: list[int], count: int, process_group: dist.ProcessGroup | None
) -> list[int]:
    """Rank 0's observed arrival order, completed to a permutation of ``range(count)``.

    Collective: every rank of the group must call it at the same point.

    Args:
        observed: parameter indices in the order their first gradient arrived here.
        count: number of parameters.
        process_group: the group to agree over (default group when None).

    Returns:
        Rank 0's ``observed``, then the indices it never saw, in reverse order.
    """
    if group_size(process_group) > 1:
        message = [list(observed)]
        dist.broadcast_object_list(
            message, src=global_rank_of(process_group, 0), group=process_group
        )
        observed = message[0]
    seen = set(observed)
    return list(observed) + [i for i in reversed(range(count)) if i not in seen]
