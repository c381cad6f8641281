"""zero1: ZeRO sharding (stages 1, 2 and 3) around a ``torch.optim`` optimizer: any
elementwise one, and Muon (or Adafactor), stepped whole on owner ranks.

Modules: :mod:`zero1.flat` (flat buckets cut into equal shards and their collectives,
shared by every stage), :mod:`zero1.buckets` (stages 1 and 2), :mod:`zero1.rooted`
(Gloo's faster collectives), :mod:`zero1.sharded_optimizer` (``ShardedOptimizer``),
:mod:`zero1.stage3` and :mod:`zero1.stage3_optimizer` (stage 3), :mod:`zero1.exchange`
(the broadcast path), :mod:`zero1.checkpoint` (state dicts and their checks),
:mod:`zero1.param_groups` (what users pass as ``params``, checked across ranks),
:mod:`zero1.group` (the process group an optimizer shards over), :mod:`zero1.muon`
(``Muon``, single-process), :mod:`zero1.whole_params` (whole parameters stepped on their
owners, over any stage's shards).
"""

from .exchange import partition_parameters
from .muon import Muon
from .param_groups import ParameterMismatchError
from .sharded_optimizer import ShardedOptimizer, optimizer_state_bytes, optimizer_state_numel
from .stage3 import shard_model, sharding_of
from .stage3_optimizer import Stage3Optimizer

__version__ = "0.7.1"

__all__ = [
    "Muon",
    "ParameterMismatchError",
    "ShardedOptimizer",
    "Stage3Optimizer",
    "optimizer_state_bytes",
    "optimizer_state_numel",
    "partition_parameters",
    "shard_model",
    "sharding_of",
]
