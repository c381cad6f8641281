"""Counting how much optimizer state a (sharded or plain) optimizer holds."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def optimizer_state_numel(optimizer: torch.optim.Optimizer) -> int:
    """Elements in every tensor of ``optimizer.state`` (step counters included).

    Args:
        optimizer: any ``torch.optim.Optimizer``; for a ``ShardedOptimizer`` this is
            the local shard only.
    """
    return sum(t.numel() for t in _tensors(dict(optimizer.state)))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes in every tensor of ``optimizer.state`` (step counters included).

    Args:
        optimizer: any ``torch.optim.Optimizer``; for a ``ShardedOptimizer`` this is
            the local shard only.
    """
    return sum(t.numel() * t.element_size() for t in _tensors(dict(optimizer.state)))
