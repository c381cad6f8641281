"""Many tensors handled as one: copying or zeroing a list of tensors in one call
(:func:`copy_all`, :func:`zero_all`), packing tensors into one flat buffer and back
(:func:`flatten_tensors`, :func:`unflatten_into`, grouped by :func:`group_by_dtype_device`),
and gradients turned into views of a flat bucket buffer (:func:`adopt_gradients`).

Communication-free; :class:`~minddp.DDPBucketed`, :func:`~minddp.broadcast_module`,
:func:`~minddp.all_reduce_gradients` and zero1's buckets build on them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["adopt_gradients", "copy_all", "flatten_tensors", "group_by_dtype_device",
           "unflatten_into", "zero_all"]


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


# ------------------------------------------------------------------ gradients as views
def adopt_gradients(params: Sequence[torch.Tensor], views: Sequence[torch.Tensor],
                    whole: torch.Tensor | None = None) -> list[int]:
    """Make every parameter's ``.grad`` its view (into a bucket), keeping what it holds.

    A gradient autograd created fresh (``.grad`` was None before backward) or one the
    user assigned is copied into the view, all of them in one call; a view autograd
    accumulated into in place stays. A parameter without a gradient gets zeros: with
    one fill of ``whole`` (a tensor covering every view) when none of them has one.

    Returns:
        The positions in ``params`` of the parameters that had no gradient.
    """
    stale: list[torch.Tensor] = []
    fresh: list[torch.Tensor] = []
    empty: list[torch.Tensor] = []
    missing: list[int] = []
    for j, (p, view) in enumerate(zip(params, views)):
        grad = p.grad
        if grad is view:
            continue
        if grad is None:
            empty.append(view)
            missing.append(j)
        else:
            stale.append(view)
            fresh.append(grad)
        p.grad = view
    if fresh:
        copy_all(stale, fresh)
    if empty:
        if whole is not None and len(empty) == len(views):
            whole.zero_()  # one fill for the bucket
        else:
            zero_all(empty)
    return missing
