"""A plan for Hugging Face Llama-style causal LMs (``LlamaForCausalLM``, and the families
that name their modules alike: Mistral, Qwen2).

Nothing here imports ``transformers``: a plan is module names and styles. Per decoder
layer: q, k, v, gate and up projections column-parallel, o and down projections
row-parallel, each attention and MLP module entering the region once
(:class:`~minitp.plan.SharedInput`: one input-gradient all-reduce each, not three and two);
the embedding and the output layer vocab-parallel.

**Heads.** Attention must see ``heads / tp`` local heads. Recent ``transformers`` (4.48 on,
so every release tested here) reshape by ``head_dim`` and infer the head count from the
projection's output, so a sharded projection is all it takes; older ones keep
``num_heads``, ``num_key_value_heads`` and ``hidden_size`` on the attention module and
reshape by them, so the plan divides those by ``tp`` where they exist
(:class:`~minitp.plan.LocalHeads` with ``required=False``). The config is left alone: it is
shared by every layer and the rotary embedding, which reads the whole model's sizes from
it. Key/value heads must divide by ``tp`` as the query heads do (``multiple_of=head_dim``
refuses a cut through a head).

**Sequence parallelism** is not supported for these models: ``LlamaModel`` builds the
positions and the causal mask from the length of the embedding's output, which would be
the local slice. Use ``sequence_parallel=False``.

**Loss.** The output layer leaves each rank its vocabulary slice of the logits: take the
loss with :func:`~minitp.vocab.vocab_parallel_cross_entropy` rather than passing
``labels=`` to the model, or build the plan with ``gather_logits=True`` to get whole
logits on every rank.
"""

from __future__ import annotations

from typing import Any

from minitp.plan import (
    ColwiseLinear,
    LocalHeads,
    Plan,
    RowwiseLinear,
    SharedInput,
    VocabEmbedding,
)

#: Attention attributes that older ``transformers`` reshape by (divided by tp where present).
LLAMA_HEAD_ATTRIBUTES = ("num_heads", "num_key_value_heads", "hidden_size")


def llama_head_dim(config: Any) -> int:
    """``config.head_dim``, or ``hidden_size // num_attention_heads`` where it is unset."""
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim or config.hidden_size // config.num_attention_heads)


def llama_plan(config: Any, *, gather_logits: bool = False, prefix: str = "model.",
               head: str = "lm_head") -> Plan:
    """The tensor-parallel plan of a Llama-style model built from ``config``.

    Args:
        config: the model's config (``LlamaConfig`` or alike): ``head_dim`` (or
            ``hidden_size`` and ``num_attention_heads``) is read from it.
        gather_logits: all-gather the output layer's vocabulary slices (whole logits on
            every rank, for the model's own loss).
        prefix: the decoder's name inside the model (``"model."`` in ``LlamaForCausalLM``,
            ``""`` for a bare ``LlamaModel``).
        head: the output layer's name (``""`` for a model without one).
    """
    head_dim = llama_head_dim(config)
    layer = f"{prefix}layers.*"
    plan: dict[str, Any] = {
        f"{prefix}embed_tokens": VocabEmbedding(),
        f"{layer}.self_attn": (SharedInput(), LocalHeads(LLAMA_HEAD_ATTRIBUTES,
                                                         required=False)),
        f"{layer}.self_attn.[qkv]_proj": ColwiseLinear(multiple_of=head_dim),
        f"{layer}.self_attn.o_proj": RowwiseLinear(multiple_of=head_dim),
        f"{layer}.mlp": SharedInput(),
        f"{layer}.mlp.gate_proj": ColwiseLinear(),
        f"{layer}.mlp.up_proj": ColwiseLinear(),
        f"{layer}.mlp.down_proj": RowwiseLinear(),
    }
    if head:
        plan[head] = ColwiseLinear(gather_output=gather_logits)
    return plan
