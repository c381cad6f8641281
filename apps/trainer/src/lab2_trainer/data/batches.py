"""Batches cut from a token stream, and drawn ahead of the step.

:class:`BatchSampler` draws random windows from a seeded, counter-based generator: the
windows of step ``s`` depend only on (seed, s), so its whole state is one integer,
checkpointing it is trivial, and every rank sees the same global batch, whatever the
number of ranks.

Drawing a batch is host work (random offsets, a gather from a memory map); done at the
start of a step, the GPU would idle through it whenever the host is not already ahead
(after a logging step's synchronisation, say). With :class:`Prefetcher` the trainer draws
batch s + 1 once step s's work is queued, while the GPU runs it, with an asynchronous copy
(``BatchSampler.next_local`` pins the host memory), so it is on the device by the time it
is needed. Prefetching draws one batch ahead of training, so the sampler's own position is
one too far for a checkpoint: :meth:`Prefetcher.state_dict` reports the batches handed out.

A sampler may also mix streams (``--stdlib-share``): each window of a batch comes from a
mixed-in stream with that stream's share as its probability, from the main one otherwise,
still a function of (seed, draw) alone.
"""

from __future__ import annotations

import numpy as np
import torch

from lab2_trainer.data.corpus import DataError


class BatchSampler:
    """Random windows of ``context_length + 1`` tokens, the same global batch on every rank.

    The windows of draw number ``n`` come from ``numpy.random.default_rng([seed, n])``:
    a counter-based scheme whose state is just ``n``, so resuming from a checkpoint, or on a
    different number of ranks, sees exactly the batches an uninterrupted run would.

    Args:
        tokens: 1-D token array.
        context_length: input length T; each window holds T + 1 tokens.
        batch_size: windows per draw (the global batch).
        seed: stream seed.
        mix: ``(tokens, share)`` pairs: streams mixed in, each window drawn from one with
            probability ``share`` (the shares sum below 1), from ``tokens`` otherwise.
            Without a mix the windows are exactly those of a sampler that has none.
    """

    def __init__(self, tokens: np.ndarray, context_length: int, batch_size: int, seed: int,
                 mix: tuple[tuple[np.ndarray, float], ...] = ()) -> None:
        for stream in (tokens, *(t for t, _ in mix)):
            if len(stream) < context_length + 1:
                raise DataError(
                    f"{len(stream)} tokens cannot fill one window of "
                    f"context_length {context_length} + 1"
                )
        shares = [share for _, share in mix]
        if any(not 0 < share < 1 for share in shares) or sum(shares) >= 1:
            raise DataError(f"mixed-in shares {shares} must each be in (0, 1) and sum below 1")
        self.tokens = tokens
        self.mix = tuple(mix)
        self.context_length = context_length
        self.batch_size = batch_size
        self.seed = seed
        self.draws = 0

    def offsets(self, draw: int) -> np.ndarray:
        """Start positions of the windows of draw number ``draw`` (a sampler without a mix)."""
        rng = np.random.default_rng([self.seed, draw])
        return rng.integers(0, len(self.tokens) - self.context_length, size=self.batch_size)

    def next_global(self) -> np.ndarray:
        """The next draw's windows as a (batch_size, T + 1) int64 array."""
        draw = self.draws
        self.draws += 1
        window = np.arange(self.context_length + 1)
        if not self.mix:
            starts = self.offsets(draw)
            return np.asarray(self.tokens[starts[:, None] + window], dtype=np.int64)
        # Each window's stream first (a uniform draw against the shares' running sums,
        # the main stream past them), then each stream's start positions in stream order.
        rng = np.random.default_rng([self.seed, draw])
        edges = np.cumsum([share for _, share in self.mix])
        stream = np.searchsorted(edges, rng.random(self.batch_size), side="right")
        out = np.empty((self.batch_size, len(window)), dtype=np.int64)
        for index, tokens in enumerate([t for t, _ in self.mix] + [self.tokens]):
            rows = np.flatnonzero(stream == index)
            starts = rng.integers(0, len(tokens) - self.context_length, size=len(rows))
            out[rows] = tokens[starts[:, None] + window]
        return out

    def next_local(
        self, rank: int, world_size: int, grad_accum: int, device: torch.device | str = "cpu"
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches of the next global batch, as (inputs, targets) pairs.

        Rank ``r`` takes the ``r``-th of ``world_size`` equal contiguous slices of the
        global batch and cuts it into ``grad_accum`` micro-batches. Equal slices are what
        make the average of the ranks' mean losses equal the global batch's mean loss.
        """
        per_rank = self.batch_size // world_size
        mine = self.next_global()[rank * per_rank : (rank + 1) * per_rank]
        micro = per_rank // grad_accum
        device = torch.device(device)
        out = []
        for i in range(grad_accum):
            chunk = torch.from_numpy(mine[i * micro : (i + 1) * micro])
            if device.type == "cuda":
                # From pinned memory the copy is asynchronous: the host queues it behind
                # the GPU's work and goes on instead of waiting for that work to finish.
                chunk = chunk.pin_memory().to(device, non_blocking=True)
            else:
                chunk = chunk.to(device)
            out.append((chunk[:, :-1], chunk[:, 1:]))
        return out

    def state_dict(self) -> dict:
        """Position in the stream (plus what must match on resume)."""
        return {"seed": self.seed, "draws": self.draws, "batch_size": self.batch_size,
                "context_length": self.context_length}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; the seed must match the one this sampler was built with."""
        if state["seed"] != self.seed:
            raise DataError(f"sampler seed {state['seed']} does not match {self.seed}")
        self.draws = int(state["draws"])


def check_batch_layout(batch_size: int, world_size: int, grad_accum: int) -> None:
    """Raise :class:`DataError` unless the global batch splits evenly into
    ``world_size`` ranks x ``grad_accum`` micro-batches of at least one window."""
    if batch_size < world_size * grad_accum:
        raise DataError(
            f"global batch {batch_size} cannot feed {world_size} rank(s) x {grad_accum} "
            f"micro-batch(es): need at least {world_size * grad_accum} windows"
        )
    if batch_size % (world_size * grad_accum) != 0:
        multiple = world_size * grad_accum
        lower = batch_size // multiple * multiple
        raise DataError(
            f"global batch {batch_size} is not divisible by world_size x grad_accum = "
            f"{world_size} x {grad_accum}; use {lower} or {lower + multiple}"
        )


# ---------------------------------------------------------------------------- prefetch
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
