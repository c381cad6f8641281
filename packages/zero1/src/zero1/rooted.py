"""A faster way to move a flat bucket on Gloo: one ``reduce`` to each shard's owner and one
``broadcast`` from each owner, the same bytes as a reduce-scatter and an all-gather.

``collectives="auto"`` picks it on Gloo (see the README's figures for when it pays);
everything else uses :class:`zero1.flat.ShardCollectives`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .flat import FlatLayout, ShardCollectives


class RootedCollectives(ShardCollectives):
    """:class:`ShardCollectives` by reduces and broadcasts. Its reductions use their input
    as scratch and leave this rank's sum in its own shard of ``send``."""

    scratches_input = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.averages = False

    def reduce_scatter(self, send: torch.Tensor, out: torch.Tensor | None,
                       layout: FlatLayout) -> tuple[list[dist.Work], torch.Tensor]:
        works = [dist.reduce(send[layout.shard(r)], dst=self.global_ranks[r],
                             op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                 for r in range(self.world_size)]
        return works, send[layout.shard(self.rank)]

    def all_gather(self, flat: torch.Tensor, layout: FlatLayout) -> list[dist.Work]:
        return [dist.broadcast(flat[layout.shard(r)], src=self.global_ranks[r],
                               group=self.group, async_op=True)
                for r in range(self.world_size)]
