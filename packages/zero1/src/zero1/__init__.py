"""zero1: optimizer-state sharding (ZeRO stage 1) around any ``torch.optim`` optimizer.

Modules: :mod:`zero1.sharded_optimizer` (the optimizer, its group, its state's size),
:mod:`zero1.buckets` (the reduce-scatter path), :mod:`zero1.exchange` (the broadcast
path: ownership and the parameter exchange), :mod:`zero1.checkpoint` (state dicts and
their checks), :mod:`zero1.param_groups` (what users pass as ``params``).
"""

from .exchange import partition_parameters
from .sharded_optimizer import ShardedOptimizer, optimizer_state_bytes, optimizer_state_numel
from .stage3 import shard_model, sharding_of
from .stage3_optimizer import Stage3Optimizer

__version__ = "0.3.0"

__all__ = [
    "ShardedOptimizer",
    "Stage3Optimizer",
    "optimizer_state_bytes",
    "optimizer_state_numel",
    "partition_parameters",
    "shard_model",
    "sharding_of",
]
