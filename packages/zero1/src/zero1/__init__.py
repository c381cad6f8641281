"""zero1: optimizer-state sharding (ZeRO stage 1) around any ``torch.optim`` optimizer."""

from .accounting import optimizer_state_bytes, optimizer_state_numel
from .partition import partition_parameters
from .sharded_optimizer import ShardedOptimizer

__version__ = "0.3.0"

__all__ = [
    "ShardedOptimizer",
    "optimizer_state_bytes",
    "optimizer_state_numel",
    "partition_parameters",
]
