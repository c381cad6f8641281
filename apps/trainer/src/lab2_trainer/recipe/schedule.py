"""The learning-rate schedule: :class:`WarmupCosine`, linear warm-up, then cosine decay to a
floor. Its peak, floor and warm-up come from :mod:`lab2_trainer.recipe.defaults` unless given.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass
class WarmupCosine:
    """Linear warm-up to ``max_lr`` over ``warmup`` steps, then cosine decay to ``min_lr``
    at step ``total``, constant after.

    Step ``s`` (0-based, the step about to be taken) gets ``max_lr * (s + 1) / warmup``
    during warm-up, so the first step already moves the weights.

    Args:
        max_lr: peak learning rate.
        min_lr: learning rate at and after ``total``.
        warmup: warm-up steps (0 for none).
        total: step at which the decay ends (usually the run's step count).
    """

    max_lr: float
    min_lr: float
    warmup: int
    total: int

    def __post_init__(self) -> None:
        if self.max_lr <= 0 or self.min_lr < 0 or self.min_lr > self.max_lr:
            raise ValueError(
                f"need 0 <= min_lr <= max_lr and max_lr > 0; got min_lr={self.min_lr}, "
                f"max_lr={self.max_lr}"
            )
        if self.warmup < 0 or self.total < 1:
            raise ValueError(f"need warmup >= 0 and total >= 1; got {self.warmup}, {self.total}")

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.max_lr * (step + 1) / self.warmup
        if step >= self.total:
            return self.min_lr
        span = max(1, self.total - self.warmup)
        progress = (step - self.warmup) / span
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.max_lr - self.min_lr) * cosine

    def state_dict(self) -> dict:
        """The schedule's parameters (it has no other state: the step is the input)."""
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict) -> WarmupCosine:
        """Rebuild a schedule saved by :meth:`state_dict`."""
        return cls(**state)
