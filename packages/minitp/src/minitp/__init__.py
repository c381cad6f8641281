"""minitp: tensor and sequence parallelism from scratch over torch.distributed.

A model's large matrices are cut over the ranks of a process group, each rank computing
with its shards, and the ranks talk only where a shard's result must be combined:

* :mod:`minitp.mappings`: the conjugate collectives (a forward collective and its adjoint
  in backward) as autograd Functions, and a counter of the bytes they move.
* :mod:`minitp.layers`: :class:`ColumnParallelLinear` and :class:`RowParallelLinear`, with
  sequence parallelism and the input-gradient reduction overlapped with the weight
  gradient.
* :mod:`minitp.vocab`: :class:`VocabParallelEmbedding` and
  :func:`vocab_parallel_cross_entropy`, which never build the whole vocabulary on a rank.
* :mod:`minitp.plan`: :func:`parallelize` shards an existing model in place by a plan of
  module-name patterns and styles.
* :mod:`minitp.llama`: the plan of Hugging Face Llama-style models.
* :mod:`minitp.random`: random numbers under tensor parallelism: the same draws where the
  ranks hold the same tensor, each rank's own where each holds a part
  (:func:`sharded_rng`, :func:`sharded_dropout`, :func:`check_same_rng`).

Everything works under ``torch.compile``: the collectives trace as functional collectives,
a region of layers is one graph.
"""

from minitp.layers import ColumnParallelLinear, RowParallelLinear
from minitp.llama import llama_plan
from minitp.mappings import (
    CommCounter,
    CommRecord,
    copy_to_region,
    count_communication,
    fallback_collectives,
    gather_from_region,
    gather_from_sequence,
    reduce_from_region,
    reduce_scatter_to_sequence,
    split_to_region,
    split_to_sequence,
    sum_gradient_over_group,
)
from minitp.plan import (
    ColwiseLinear,
    LocalHeads,
    Plan,
    PlanError,
    RowwiseLinear,
    SequenceSplit,
    SharedInput,
    VocabEmbedding,
    check_plan,
    parallelize,
)
from minitp.random import check_same_rng, sharded_dropout, sharded_rng
from minitp.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

__version__ = "0.2.0"

__all__ = [
    "ColumnParallelLinear",
    "ColwiseLinear",
    "CommCounter",
    "CommRecord",
    "LocalHeads",
    "Plan",
    "PlanError",
    "RowParallelLinear",
    "RowwiseLinear",
    "SequenceSplit",
    "SharedInput",
    "VocabEmbedding",
    "VocabParallelEmbedding",
    "check_plan",
    "check_same_rng",
    "copy_to_region",
    "count_communication",
    "fallback_collectives",
    "gather_from_region",
    "gather_from_sequence",
    "llama_plan",
    "parallelize",
    "reduce_from_region",
    "reduce_scatter_to_sequence",
    "sharded_dropout",
    "sharded_rng",
    "split_to_region",
    "split_to_sequence",
    "sum_gradient_over_group",
    "vocab_parallel_cross_entropy",
]
