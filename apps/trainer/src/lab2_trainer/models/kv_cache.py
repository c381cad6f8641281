"""The KV cache for decoding: keys and values of past positions, kept per attention layer
so that decoding a token costs one position.

Without a cache, generating each token runs the whole context through the
model again. With one, the prompt is run once (the *prefill*), every attention layer keeps
its keys and values, and each new token runs alone, attending to the kept ones. The cache
holds up to ``capacity`` positions (the model's context length: positions are learned
absolute embeddings, so there is none beyond it). Storage is allocated at the first
write, in the dtype and on the device of the keys (so bf16 under autocast), and positions
are filled in order: ``length`` is the number filled and the absolute position of the next.
"""

from __future__ import annotations

import torch


class LayerKV:
    """One attention layer's keys and values, (B, heads, capacity, head_dim) each.

    Args:
        owner: the :class:`KVCache` whose ``length`` says where the next write goes.
    """

    def __init__(self, owner: KVCache) -> None:
        self.owner = owner
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Store ``k`` and ``v`` (B, heads, t, head_dim) after the positions already held.

        Returns:
            (keys, values, start): every position held so far, these included, and the
            absolute position of ``k``'s first row.

        Raises:
            ValueError: the positions would run past the capacity, or the batch or head
                layout differs from the first write.
        """
        start = self.owner.length
        end = start + k.shape[2]
        if end > self.owner.capacity:
            raise ValueError(f"KV cache holds {self.owner.capacity} positions; writing "
                             f"{k.shape[2]} after {start} would run past it")
        if self.keys is None:
            shape = (*k.shape[:2], self.owner.capacity, k.shape[3])
            self.keys = k.new_empty(shape)
            self.values = v.new_empty(shape)
        elif k.shape[:2] != self.keys.shape[:2] or k.shape[3] != self.keys.shape[3]:
            raise ValueError(f"KV cache was filled with (batch, heads, _, head_dim) = "
                             f"{tuple(self.keys.shape)}, got keys of shape {tuple(k.shape)}")
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        return self.keys[:, :, :end], self.values[:, :, :end], start


class KVCache:
    """Per-layer keys and values for incremental decoding.

    The model's cached forward writes every layer at ``length``, then advances ``length``
    by the tokens it ran. ``reset`` empties it without freeing the storage.

    Args:
        n_layers: attention layers of the model.
        capacity: most positions held (the model's context length).
    """

    def __init__(self, n_layers: int, capacity: int) -> None:
        if n_layers < 1 or capacity < 1:
            raise ValueError(f"KVCache needs n_layers >= 1 and capacity >= 1, got "
                             f"{n_layers} and {capacity}")
        self.capacity = capacity
        self.length = 0
        self.layers = [LayerKV(self) for _ in range(n_layers)]

    @property
    def free(self) -> int:
        """Positions left before the cache is full."""
        return self.capacity - self.length

    def advance(self, tokens: int) -> None:
        """Count ``tokens`` more positions as held (after every layer has written them)."""
        if not 0 < tokens <= self.free:
            raise ValueError(f"cannot advance a KV cache with {self.free} free positions by "
                             f"{tokens}")
        self.length += tokens

    def reset(self) -> None:
        """Forget every position (the storage is kept for the next prefill)."""
        self.length = 0
