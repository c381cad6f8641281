"""Copying a module from one rank to all others (:func:`broadcast_module`), after checking
that every rank holds the same model."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from minddp.comm import global_rank_of, group_rank, group_size
from minddp.flat import flatten_tensors, group_by_dtype_device, unflatten_into
from minddp.model_check import check_model_consistency

__all__ = ["broadcast_module"]


# Coalesce at most this many bytes per broadcast: few collectives, bounded extra memory.
_CHUNK_BYTES = 32 * 1024 * 1024


def _chunks(tensors: list[torch.Tensor], indices: list[int]) -> list[list[torch.Tensor]]:
    out: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    size = 0
    for i in indices:
        t = tensors[i]
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > _CHUNK_BYTES:
            out.append(current)
            current, size = [], 0
        current.append(t)
        size += nbytes
    if current:
        out.append(current)
    return out


@torch.no_grad()
def broadcast_module(
    module: nn.Module, src: int = 0, *, process_group: dist.ProcessGroup | None = None,
    check: bool = True,
) -> None:
    """Overwrite every parameter and buffer of ``module`` with rank ``src``'s values.

    Tensors are packed per dtype/device into flat chunks of at most 32 MiB, so a
    model costs a handful of broadcasts rather than one per tensor. First the ranks'
    models are compared (:func:`~minddp.check_model_consistency`: one small all-gather
    of a digest): broadcasting into a model of other shapes or dtypes would copy one
    tensor's values into another's.

    Args:
        module: the model; modified in place on every rank but ``src``.
        src: the source rank, counted inside ``process_group``.
        process_group: the group to broadcast over (default group when None).
        check: compare the models first (leave it on unless the caller just did).

    Raises:
        ModelMismatchError: on every rank, when the models differ; nothing is copied.
    """
    world = group_size(process_group)
    if not 0 <= src < world:
        raise ValueError(f"src must be a rank in [0, {world}), got {src}")
    if world == 1:
        return
    if check:
        check_model_consistency(module, process_group=process_group)
    tensors = [p.detach() for p in module.parameters()] + [b for b in module.buffers()]
    is_src = group_rank(process_group) == src
    root = global_rank_of(process_group, src)
    for indices in group_by_dtype_device(tensors):
        for chunk in _chunks(tensors, indices):
            flat = flatten_tensors(chunk)
            dist.broadcast(flat, src=root, group=process_group)
            if not is_src:
                unflatten_into(flat, chunk)
