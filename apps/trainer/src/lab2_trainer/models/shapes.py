"""Arithmetic on the model's shape, without torch, on Python integers: parameter counts,
FLOPs per token and the bytes of the training state. The planner, the checks before a run
and the report all count with it.

FLOPs per token of a training step are the PaLM paper's (appendix B):
``6 N + 12 n_layers d_model context_length``, ``N`` the parameters that take part in a
matrix product (not the embedding tables, which are lookups) and the second term
attention's own products; a forward is a third. A recomputed block adds its forward.
"""

from __future__ import annotations

from typing import Any


# ------------------------------------------------------------------------- parameters
def block_matmul_parameters(config: Any) -> int:
    """Parameters of one decoder block's matrix products (attention's four projections and
    the feed-forward's two or three matrices; rope and qk_norm add none)."""
    ffn = 3 if config.ffn == "swiglu" else 2
    return 4 * config.d_model * config.d_model + ffn * config.d_model * config.d_ff


def parameter_counts(config: Any) -> dict[str, int]:
    """The model's parameters by kind: ``block`` (one block's), ``block_matmul`` (its
    matrices'), ``blocks``, ``embeddings`` (token and position tables; no position table
    under rope), ``head`` (the LM
    head, 0 when tied), ``norms`` (the final norm), ``total``, and ``matmul``: those that
    take part in matrix products (the ``N`` of the FLOPs)."""
    d = config.d_model
    norm = 2 * d if config.norm == "layernorm" else d  # LayerNorm has a bias
    block_matmul = block_matmul_parameters(config)
    block = block_matmul + 2 * norm
    positions = 0 if getattr(config, "rope", False) else config.context_length
    embeddings = (config.vocab_size + positions) * d
    head = 0 if config.tie_embeddings else config.vocab_size * d
    total = config.n_layers * block + embeddings + head + norm
    # All but the position table, and the token table unless it is the head.
    matmul = total - positions * d - (0 if config.tie_embeddings
                                                  else config.vocab_size * d)
    return {"block": block, "block_matmul": block_matmul, "blocks": config.n_layers * block,
            "embeddings": embeddings, "head": head, "norms": norm, "total": total,
            "matmul": matmul}


def muon_parameter_count(config: Any) -> int:
    """Elements of the matrices ``--optimizer muon`` steps with Muon: every block's matrix
    products' weights (lab2_trainer.recipe.muon)."""
    return config.n_layers * block_matmul_parameters(config)


def rank_parameter_counts(config: Any, tp: int) -> dict[str, int]:
    """:func:`parameter_counts` of one of ``tp`` tensor-parallel ranks: 1/tp of every block
    matrix, of the token table and of the head; the position table and the norms whole.
    ``tp`` 1 is the whole model's."""
    counts = parameter_counts(config)
    if tp == 1:
        return counts
    tokens = config.vocab_size * config.d_model
    block_matmul = counts["block_matmul"] // tp
    block = block_matmul + counts["block"] - counts["block_matmul"]
    tables = counts["embeddings"] - tokens + tokens // tp
    head = counts["head"] // tp
    total = config.n_layers * block + tables + head + counts["norms"]
    return {"block": block, "block_matmul": block_matmul, "blocks": config.n_layers * block,
            "embeddings": tables, "head": head, "norms": counts["norms"], "total": total,
            "matmul": counts["matmul"] // tp}  # every matrix product's weight is cut


def parameter_count(config: Any) -> int:
    """The model's parameters (:func:`parameter_counts`' ``total``)."""
    return parameter_counts(config)["total"]


# ------------------------------------------------------------------------------ FLOPs
def training_flops_per_token(config: Any, n_matmul_params: int) -> float:
    """Model FLOPs of one token's forward and backward: ``6 N + 12 L d T``."""
    attention = 12 * config.n_layers * config.d_model * config.context_length
    return 6 * n_matmul_params + attention


def recompute_flops(config: Any, blocks: int) -> float:
    """Forward FLOPs per token that recomputing ``blocks`` blocks in backward adds: their
    matrix products and attention's products."""
    per_block = 2 * block_matmul_parameters(config) + 4 * config.d_model * config.context_length
    return float(blocks * per_block)


def flops_per_token(config: Any, checkpointing: str) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) per token of a training step: ``6 N + 12 L d T``, and
    that plus the recomputed forwards: every block for ``full``, none for ``none`` and the
    op-level ``selective`` policy (which recomputes no matrix product)."""
    model = training_flops_per_token(config, parameter_counts(config)["matmul"])
    blocks = config.n_layers if checkpointing == "full" else 0
    return float(model), float(model + recompute_flops(config, blocks))


# ---------------------------------------------------------------------- training state
def training_state_parts(n: int, sharding: str, world_size: int,
                         reshard_after_forward: bool = True, muon: int = 0) -> dict[str, int]:
    """:func:`training_state_bytes` item by item: ``parameters``, ``gradients`` and
    ``optimizer`` bytes per rank (the gathered weights of zero3 and fsdp without resharding count
    among the parameters). ``muon`` of the ``n`` elements are Muon's, whose state is one
    fp32 momentum buffer (4 bytes) where AdamW keeps two moments (8)."""
    shards = max(1, world_size)
    params, grads, state = 4 * n, 4 * n, (8 * n - 4 * muon) // shards
    if sharding == "none":
        state = 8 * n - 4 * muon
    elif sharding == "zero2":
        grads = 4 * n // shards
    elif sharding in ("zero3", "fsdp"):
        params = 4 * n // shards + (0 if reshard_after_forward else 4 * n)
        grads = 4 * n // shards
    return {"parameters": params, "gradients": grads, "optimizer": state}


def training_state_bytes(n: int, sharding: str, world_size: int,
                         reshard_after_forward: bool = True, muon: int = 0) -> int:
    """Bytes per rank of fp32 weights (4), gradients (4) and AdamW's two moments (8) of
    ``n`` parameters, by sharding kind (a lower bound: no bucket or gathered block):

    * none: 4 + 4 + 8 per parameter;
    * zero1, zero1-allreduce, torch (state sharded): 4 + 4 + 8/N;
    * zero2 (gradients sharded too): 4 + (4 + 8)/N;
    * zero3, fsdp (parameters too): (4 + 4 + 8)/N, and with reshard_after_forward off the
      whole gathered weights (4) through the backward besides;
    * with ``muon`` elements stepped by Muon, 4 bytes fewer each (one momentum buffer).
    """
    return sum(training_state_parts(n, sharding, world_size, reshard_after_forward,
                                    muon).values())


def checkpoint_bytes(n: int, world_size: int) -> dict[str, int]:
    """What one sharded checkpoint of ``n`` parameters holds: fp32 weights and AdamW's two
    moments, 12 bytes a parameter (``total``, on disk, DCP's few bytes of framing aside),
    and what each rank copies to CPU memory and writes (``per_rank``): its 1/N ranges, for
    every sharding kind, replicated tensors written in equal slices. No rank gathers more
    (``gathered``: 0), where a single-file checkpoint gathers ``total`` on one rank."""
    total = 12 * n
    return {"total": total, "per_rank": -(-total // max(1, world_size)), "gathered": 0}
