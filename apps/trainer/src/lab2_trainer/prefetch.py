"""The next step's batch, drawn and sent to the device while the current step runs.

Drawing a batch is host work (random offsets, a gather from a memory map); done at the
start of a step, the GPU would idle through it whenever the host is not already ahead
(after a logging step's synchronisation, say). With :class:`Prefetcher` the trainer draws
batch s + 1 once step s's work is queued, while the GPU runs it, with an asynchronous copy
(``BatchSampler.next_local`` pins the host memory), so it is on the device by the time it
is needed.

Prefetching draws one batch ahead of training, so the sampler's own position is one too
far for a checkpoint: :meth:`Prefetcher.state_dict` reports the batches handed out.
"""

from __future__ import annotations

import torch

from lab2_trainer.data import BatchSampler


class Prefetcher:
    """Hands out ``sampler``'s batches for one rank, each drawn one step in advance.

    Args:
        sampler: the global batch sampler (already at its resume position).
        rank, world_size, grad_accum: this rank's slice and micro-batches.
        device: where the batches go.
    """

    def __init__(self, sampler: BatchSampler, rank: int, world_size: int, grad_accum: int,
                 device: torch.device) -> None:
        self.sampler = sampler
        self._args = (rank, world_size, grad_accum, device)
        self.consumed = sampler.draws
        self._next: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def _draw(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.sampler.next_local(*self._args)

    def next(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This step's micro-batches: the prefetched ones, or drawn now if none are."""
        batch = self._next if self._next is not None else self._draw()
        self._next = None
        self.consumed += 1
        return batch

    def prefetch(self) -> None:
        """Draw the next step's micro-batches now (call once the current step is queued)."""
        if self._next is None:
            self._next = self._draw()

    def state_dict(self) -> dict:
        """The sampler's state at the batches handed out (not the one drawn ahead)."""
        return {**self.sampler.state_dict(), "draws": self.consumed}
