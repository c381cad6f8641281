"""Communication helpers every variant shares: process-group queries, the in-place
averaging all-reduce, list-wide copies, flat packing, and the broadcast of a whole module.

Sections, in order: the process group; averaging (:class:`Averager`); copying or zeroing
a list of tensors in one call (:func:`copy_all`, :func:`zero_all`); packing tensors into
one flat buffer and back; copying a module from one rank to all others
(:func:`broadcast_module`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn


# ------------------------------------------------------------------ process group
def require_initialized() -> None:
    """Raise a clear error when torch.distributed has no default process group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "minddp needs an initialized process group: call "
            "torch.distributed.init_process_group(...) before using it"
        )


def group_size(process_group: dist.ProcessGroup | None) -> int:
    """World size of ``process_group`` (the default group when None)."""
    require_initialized()
    return dist.get_world_size(group=process_group)


def group_rank(process_group: dist.ProcessGroup | None) -> int:
    """This process's rank inside ``process_group`` (the default group when None)."""
    require_initialized()
    return dist.get_rank(group=process_group)


def global_rank_of(process_group: dist.ProcessGroup | None, rank_in_group: int) -> int:
    """Translate a rank inside ``process_group`` to the global rank collectives expect."""
    if process_group is None or process_group is dist.GroupMember.WORLD:
        return rank_in_group
    get = getattr(dist, "get_global_rank", None) or dist.distributed_c10d._get_global_rank
    return get(process_group, rank_in_group)


# ------------------------------------------------------------------ averaging
# One asynchronous in-place all-reduce that leaves the average, launched from inside
# backward: NCCL averages natively (no division pass), Gloo divides first then sums; the
# group object is called directly with options built once (no per-call argument checks);
# a group of one launches nothing. The figures: docs/benchmarks/README.md (host time).
class _Done:
    """The handle of an average that needed no collective (a group of one)."""

    __slots__ = ()

    def wait(self, timeout: object = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


_DONE = _Done()


class Averager:
    """Averages tensors over a process group, one asynchronous all-reduce each.

    Args:
        process_group: the group to average over (default group when None).

    Attributes:
        world_size: size of the group.
        native_average: True when the backend averages in the collective itself.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.world_size = group_size(process_group)
        self._group = process_group if process_group is not None else dist.group.WORLD
        avg = getattr(dist.ReduceOp, "AVG", None)
        self.native_average = avg is not None and dist.get_backend(process_group) == "nccl"
        self._op = avg if self.native_average else dist.ReduceOp.SUM
        self._options = None
        if hasattr(dist, "AllreduceOptions") and hasattr(self._group, "allreduce"):
            self._options = dist.AllreduceOptions()
            self._options.reduceOp = self._op

    def start(self, tensor: torch.Tensor) -> dist.Work:
        """Begin averaging ``tensor`` in place; ``wait()`` on the result before reading it."""
        if self.world_size == 1:
            return _DONE  # type: ignore[return-value]
        if not self.native_average and self.world_size > 1:
            tensor.div_(self.world_size)
        if self._options is not None:
            return self._group.allreduce([tensor], self._options)
        return dist.all_reduce(tensor, op=self._op, group=self._group, async_op=True)


# ------------------------------------------------------------------ list-wide copies
# Copy or zero a list of tensors in one ``torch._foreach_*`` call instead of a Python loop
# that pays the dispatcher (or a kernel launch) once per tensor.
_copy = getattr(torch, "_foreach_copy_", None)
_zero = getattr(torch, "_foreach_zero_", None)


def copy_all(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``d.copy_(s)`` for every pair (same shapes, dtypes and devices pairwise)."""
    if _copy is not None and len(destinations) > 1:  # one tensor: copy_ has less to check
        _copy(destinations, sources)
        return
    for d, s in zip(destinations, sources):
        d.copy_(s)


def zero_all(tensors: list[torch.Tensor]) -> None:
    """``t.zero_()`` for every tensor."""
    if _zero is not None and len(tensors) > 1:
        _zero(tensors)
        return
    for t in tensors:
        t.zero_()


# ------------------------------------------------------------------ flat packing
# Pack several tensors into one contiguous buffer and back.
def flatten_tensors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate same-dtype, same-device tensors into one new 1-D tensor."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors`` (in place)."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def group_by_dtype_device(
    tensors: Sequence[torch.Tensor],
) -> list[list[int]]:
    """Indices of ``tensors`` grouped by (dtype, device), groups ordered by first appearance.

    Order within and across groups only depends on the tensor list, so ranks with
    the same model form the same groups in the same order.
    """
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    return list(groups.values())


# ------------------------------------------------------------------ broadcasting a module
# Copy a module's parameters and buffers from one rank to all others.

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
        from minddp.model_check import check_model_consistency  # it imports this module

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
