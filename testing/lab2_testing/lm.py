"""Inputs for language-model tests."""

from __future__ import annotations

import torch


def random_windows(steps: int, batch: int, vocab: int, context: int,
                   seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of ``batch`` random token windows: inputs ``[batch, context]`` and
    their next-token targets, the same for every caller of the same arguments."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        window = torch.randint(0, vocab, (batch, context + 1), generator=gen)
        out.append((window[:, :-1], window[:, 1:]))
    return out
