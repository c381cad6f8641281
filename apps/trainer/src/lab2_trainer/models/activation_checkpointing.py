"""**Activation checkpointing** of the decoder blocks (``--activation-checkpointing``), three
kinds (:data:`~lab2_trainer.config.ACTIVATION_CHECKPOINTING`):

* ``none``: autograd keeps every tensor the backward needs.
* ``full``: each block keeps only its inputs (the residual stream and the pending branch
  output); its forward runs again inside the backward, block by block
  (``torch.utils.checkpoint.checkpoint(use_reentrant=False)``). One extra forward of the
  blocks per step: about a third more matrix-product FLOPs.
* ``selective``: an op-level policy (``torch.utils.checkpoint``'s
  ``create_selective_checkpoint_contexts``) keeps the outputs of the matrix products and
  of attention, and recomputes the rest of the block (the norms, SiLU and its product,
  casts and copies). Recomputing those costs no matrix-product FLOPs and only a few
  memory-bound kernels, while what is dropped (norm outputs, the SwiGLU's gate and product)
  is about 40% of a block's activations. Every-other-block checkpointing saves a little
  more memory but recomputes half a forward of matrix products, about 17% more FLOPs per
  step; the op-level policy is nearly free, so it is the one ``selective`` means. Where
  torch lacks the policy API, ``selective`` falls back to checkpointing every other block
  in full (with a warning), and :func:`selective_kind` says so.

Gradients are reduced once: the DDP wrappers' and zero1's hooks are post-accumulate-grad
hooks on the parameters, and a recomputed forward accumulates no gradient. The checkpoint
is taken inside each block's forward (:meth:`Block.forward`), so module hooks (FSDP2's)
run around it and never in the recompute, whose parameters FSDP2's pre-backward hook has
gathered; and a compiled block holds its checkpoint in its graph.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import checkpoint as _ckpt

from lab2_trainer.config import ACTIVATION_CHECKPOINTING


def _saved_operators() -> set[Any]:
    """The operators whose outputs ``selective`` keeps: matrix products and attention."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_flash_attention_forward", "_efficient_attention_forward")
    found = set()
    for name in names:
        packet = getattr(aten, name, None)
        if packet is not None:
            found.add(packet.default)
    return found


def has_op_policy() -> bool:
    """Whether this torch has the op-level policy API ``selective`` uses."""
    return hasattr(_ckpt, "create_selective_checkpoint_contexts") and hasattr(
        _ckpt, "CheckpointPolicy")


def selective_kind() -> str:
    """What ``selective`` does with this torch: "op" (keep matrix-product and attention
    outputs, recompute the rest) or "every-other-block" (the fallback)."""
    return "op" if has_op_policy() else "every-other-block"


def _build_policy_context() -> Callable[[], Any]:
    """The ``context_fn`` of the op-level policy."""
    policy_enum = _ckpt.CheckpointPolicy
    saved = frozenset(_saved_operators())

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if op in saved:
            return policy_enum.MUST_SAVE
        return policy_enum.PREFER_RECOMPUTE

    return functools.partial(_ckpt.create_selective_checkpoint_contexts, policy)


# Built at import: torch.compile then reads a module global instead of tracing the build.
POLICY_CONTEXT = _build_policy_context() if has_op_policy() else None


def check_kind(kind: str) -> str:
    """``kind`` if it is one of :data:`~lab2_trainer.config.ACTIVATION_CHECKPOINTING`, else
    ``ValueError``."""
    if kind not in ACTIVATION_CHECKPOINTING:
        raise ValueError("activation checkpointing must be one of "
                         f"{', '.join(ACTIVATION_CHECKPOINTING)}; got {kind!r}")
    return kind


_warned = False


def block_checkpointing(kind: str, index: int) -> str:
    """How block ``index`` is checkpointed when the model's kind is ``kind``: ``kind``
    itself, except for "selective" on a torch without the op-level policy, which falls
    back to "full" on every other block (with a warning) and "none" on the rest."""
    check_kind(kind)
    if kind != "selective" or has_op_policy():
        return kind
    global _warned
    if not _warned:
        _warned = True
        warnings.warn("this torch has no create_selective_checkpoint_contexts: "
                      "--activation-checkpointing selective checkpoints every other block "
                      "in full instead", stacklevel=3)
    return "full" if index % 2 == 0 else "none"


def recomputed_blocks(kind: str, n_layers: int) -> int:
    """How many blocks' forward matrix products run again in backward: none (``none``, and
    the op-level ``selective`` policy, which recomputes no matrix product), all (``full``),
    every other one (the fallback of ``selective``)."""
    check_kind(kind)
    if kind == "full":
        return n_layers
    if kind == "selective" and selective_kind() == "every-other-block":
        return (n_layers + 1) // 2
    return 0
