"""Finding this rank's place in the process group, and checking ranks agree."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


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


def layout_fingerprint(groups: Sequence[Sequence[torch.Tensor]]) -> str:
    """A short digest of every group's parameter shapes and dtypes."""
    text = repr([[(tuple(p.shape), str(p.dtype)) for p in params] for params in groups])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_same_on_every_rank(info: GroupInfo, groups: Sequence[Sequence[torch.Tensor]],
                             what: str) -> None:
    """Collective: raise ValueError on every rank unless all ranks pass the same layout.

    The partition is computed locally, so ranks given different parameters would
    disagree on who owns what and then deadlock or corrupt each other's weights.
    """
    if info.world_size == 1:
        return
    mine = layout_fingerprint(groups)
    everyone: list[Any] = [None] * info.world_size
    dist.all_gather_object(everyone, mine, group=info.group)
    differing = [r for r, fp in enumerate(everyone) if fp != everyone[0]]
    if differing:
        raise ValueError(
            f"ShardedOptimizer.{what}: ranks {differing} passed parameters whose shapes or "
            "dtypes differ from rank 0's; every rank must pass the same parameters"
        )
