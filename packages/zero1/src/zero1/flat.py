"""Flat buckets cut into equal shards: the layout and the collectives every ZeRO stage shares.

A bucket is one flat buffer that holds several tensors back to back, padded to a multiple
of the world size N and cut into N equal shards: rank r owns elements ``[r*C, (r+1)*C)``,
``C = padded / N``. A tensor may straddle shards; the part of it inside a rank's shard is a
*piece* (a 1-D view), which is what that rank steps. Equal shards are what
``reduce_scatter_tensor`` and ``all_gather_into_tensor`` need.

The API, used by stages 1 and 2 (:mod:`zero1.buckets`) and open to stage 3:

* :class:`FlatLayout` ``.of(numels, world_size)``: offsets, padding, shard size,
  :meth:`FlatLayout.pieces` (which part of which member lies in a rank's shard) and
  :meth:`FlatLayout.spans` (which ranks hold which part of each member);
* :func:`member_views` and :func:`bind`: the members as views of a flat buffer;
* :class:`ShardCollectives`: ``reduce_scatter`` of a flat bucket into this rank's shard
  (the sum) and ``all_gather`` of the shards back into the flat bucket, in place;
* :class:`Piece`: what an optimizer of any stage steps for one parameter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class FlatLayout:
    """Where each member of one flat bucket lies, and how the bucket is sharded.

    Attributes:
        numels: elements of each member, in buffer order.
        offsets: each member's first element in the buffer.
        numel: real elements (the sum of ``numels``).
        padded: buffer length, a multiple of ``world_size`` (at least ``world_size``).
        world_size: N, the number of shards.
    """

    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    padded: int
    world_size: int

    @classmethod
    def of(cls, numels: Sequence[int], world_size: int) -> FlatLayout:
        offsets, total = [], 0
        for n in numels:
            offsets.append(total)
            total += n
        padded = max(world_size, math.ceil(total / world_size) * world_size)
        return cls(tuple(numels), tuple(offsets), total, padded, world_size)

    @property
    def shard_numel(self) -> int:
        """C, the elements of one shard."""
        return self.padded // self.world_size

    def shard(self, rank: int) -> slice:
        """Rank ``rank``'s elements of the buffer."""
        c = self.shard_numel
        return slice(rank * c, (rank + 1) * c)

    def pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """``(member, lo, hi)``: member ``member``'s elements ``[lo, hi)`` of the buffer
        lie in ``rank``'s shard (only members with some there, in buffer order)."""
        mine = self.shard(rank)
        out = []
        for j, (offset, n) in enumerate(zip(self.offsets, self.numels)):
            lo, hi = max(offset, mine.start), min(offset + n, mine.stop)
            if lo < hi:
                out.append((j, lo, hi))
        return out

    def spans(self) -> list[list[tuple[int, int, int]]]:
        """Per member, ``(rank, start, numel)`` of each rank holding part of it: elements
        ``[start, start + numel)`` of the flattened member lie in ``rank``'s shard (ranks
        in order; what :mod:`zero1.whole_params` gathers a member from)."""
        out: list[list[tuple[int, int, int]]] = [[] for _ in self.numels]
        for rank in range(self.world_size):
            for j, lo, hi in self.pieces(rank):
                out[j].append((rank, lo - self.offsets[j], hi - lo))
        return out


def member_views(flat: torch.Tensor, shapes: Sequence[torch.Size],
                 layout: FlatLayout) -> list[torch.Tensor]:
    """Each member's slice of ``flat``, shaped like it."""
    return [flat[o : o + n].view(s) for o, n, s in zip(layout.offsets, layout.numels, shapes)]


@torch.no_grad()
def bind(params: Sequence[torch.Tensor], flat: torch.Tensor, layout: FlatLayout) -> None:
    """Copy each parameter's values into its view of ``flat`` and rebind it there
    (``p.data = view``): the ``Parameter`` objects stay, their old storage goes."""
    for p, view in zip(params, member_views(flat, [p.shape for p in params], layout)):
        view.copy_(p.data)
        p.data = view


class ShardCollectives:
    """The two collectives of a flat bucket over one process group.

    Args:
        group: the process group (None: the default group).
        rank: this process's rank in ``group``.
        global_ranks: the global rank of each group rank.

    Attributes:
        averages: ``reduce_scatter`` leaves the average (NCCL's ``AVG``), else the sum.
        scratches_input: ``reduce_scatter`` may overwrite ``send`` (False here).
    """

    scratches_input = False

    def __init__(self, group: dist.ProcessGroup | None, rank: int,
                 global_ranks: Sequence[int]) -> None:
        self.group = group
        self.rank = rank
        self.world_size = len(global_ranks)
        self.global_ranks = list(global_ranks)
        avg = getattr(dist.ReduceOp, "AVG", None)
        self.averages: bool = avg is not None and dist.get_backend(group) == "nccl"
        self._op = avg if self.averages else dist.ReduceOp.SUM

    def reduce_scatter(self, send: torch.Tensor, out: torch.Tensor | None,
                       layout: FlatLayout) -> tuple[list[dist.Work], torch.Tensor]:
        """Start reducing ``send`` (a padded flat bucket) over the ranks so that this rank
        gets its shard of the result, in ``out`` (``layout.shard_numel`` elements; None:
        a new tensor). Returns the work to wait for and where the result lands."""
        if out is None:
            out = send.new_empty(layout.shard_numel)
        work = dist.reduce_scatter_tensor(out, send, op=self._op, group=self.group,
                                          async_op=True)
        return [work], out

    def all_gather(self, flat: torch.Tensor, layout: FlatLayout) -> list[dist.Work]:
        """Start filling ``flat`` with every rank's shard of it, from this rank's own."""
        return [dist.all_gather_into_tensor(flat, flat[layout.shard(self.rank)],
                                            group=self.group, async_op=True)]


@dataclass
class Piece:
    """The part of one parameter a rank steps.

    Attributes:
        param: the model's parameter.
        local: what the local optimizer holds: the parameter itself (broadcast path,
            one rank) or a 1-D view of the flat buffer (bucket path).
        start: offset of ``local``'s first element in the flattened parameter.
    """

    param: torch.Tensor
    local: torch.Tensor
    start: int
