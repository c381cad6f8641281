"""The prefetcher hands out the sampler's batches in order and checkpoints the batches used."""

from __future__ import annotations

import numpy as np
import torch

from lab2_trainer.data.batches import BatchSampler, Prefetcher


def test_prefetched_batches_are_the_samplers_and_the_state_counts_those_used():
    tokens = np.random.default_rng(0).integers(1, 256, size=5000)
    plain = BatchSampler(tokens, 16, 8, seed=3)
    fetched = Prefetcher(BatchSampler(tokens, 16, 8, seed=3), 1, 2, 2, torch.device("cpu"))
    for step in range(4):
        want = plain.next_local(1, 2, 2)
        got = fetched.next()
        assert len(got) == 2
        for (wx, wy), (gx, gy) in zip(want, got):
            assert torch.equal(wx, gx) and torch.equal(wy, gy)
        if step != 2:  # a step without prefetch draws on demand
            fetched.prefetch()
        # Drawn one ahead, yet the state is at the batches handed out.
        assert fetched.state_dict() == plain.state_dict()
    fetched.prefetch()  # idempotent until the batch is taken
    fetched.prefetch()
    assert torch.equal(fetched.next()[0][0], plain.next_local(1, 2, 2)[0][0])
