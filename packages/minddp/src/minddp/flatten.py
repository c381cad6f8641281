"""Pack several tensors into one contiguous buffer and back."""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
