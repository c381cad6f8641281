"""The process group an optimizer shards over, as the optimizer sees it (:class:`GroupInfo`):
its rank, its size and the global rank of each member, resolved once
(:func:`resolve_group`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["GroupInfo", "resolve_group"]


@dataclass(frozen=True)
class GroupInfo:
    """This process's view of the group the optimizer shards over.

    Attributes:
        group: the process group, or None for the default group / no group at all.
        rank: this process's rank in ``group``.
        world_size: number of ranks in ``group``.
        global_ranks: the global rank of each group rank.
    """

    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    global_ranks: tuple[int, ...]


def resolve_group(process_group: dist.ProcessGroup | None) -> GroupInfo:
    """Rank and size of ``process_group`` (the default group when None).

    Without an initialised ``torch.distributed`` the optimizer runs alone (one rank,
    no collectives), unless ``WORLD_SIZE`` says this process is one of several, which
    almost surely means ``init_process_group`` was forgotten.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise RuntimeError(
                "ShardedOptimizer: a process_group was given but torch.distributed is not "
                "initialized"
            )
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise RuntimeError(
                "ShardedOptimizer: WORLD_SIZE > 1 but torch.distributed is not initialized; "
                "call torch.distributed.init_process_group first"
            )
        return GroupInfo(None, 0, 1, (0,))
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise ValueError("ShardedOptimizer: this process is not a member of process_group")
    world_size = dist.get_world_size(process_group)
    group = process_group if process_group is not None else dist.group.WORLD
    global_ranks = tuple(dist.get_process_group_ranks(group))
    return GroupInfo(process_group, rank, world_size, global_ranks)
