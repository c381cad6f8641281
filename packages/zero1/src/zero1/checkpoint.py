"""Converting between shard state and the full state dict of a plain optimizer.

A plain ``torch.optim`` state dict numbers parameters 0, 1, 2, ... through the groups
in order, keys ``state`` by those numbers, and lists them under each group's
``params``. A shard's local optimizer numbers only its own parameters; these helpers
translate with the list ``local_to_global`` (the global number of each local one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .param_groups import hyperparameters


def to_cpu(value: Any) -> Any:
    """A copy of ``value`` with every tensor inside it moved to the CPU (for sending)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


def state_of_pieces(state: Mapping[torch.Tensor, Any],
                    numbered: Sequence[tuple[int, Any]]) -> list[tuple[int, int | None, Any]]:
    """A rank's state on the CPU, as ``(global number, start, state)`` per piece; start is
    None for a parameter held whole (its state keeps its own shapes).

    Reads ``state`` for the given pieces only: ``optimizer.state`` is a defaultdict, and
    code that merely looked up another tensor left an empty entry for it, which must not
    reach the checkpoint.

    Args:
        state: the local optimizer's ``state`` (keyed by the pieces' local tensors).
        numbered: ``(global parameter number, piece)`` for each piece this rank holds
            (:class:`zero1.buckets.Piece`).
    """
    return [(index, None if piece.local is piece.param else piece.start,
             to_cpu(state[piece.local]))
            for index, piece in numbered if state.get(piece.local)]


def merge_pieces(shards: Sequence[Sequence[tuple[int, int | None, Any]]],
                 shapes: Sequence[torch.Size]) -> dict[int, Any]:
    """One ``state`` mapping in global parameter order from every rank's pieces.

    A parameter held whole by one rank keeps its state as it is. A parameter cut into
    pieces (flattened, ``start`` its first element) gets each tensor of more than zero
    dimensions concatenated in order and shaped like the parameter, and each scalar
    (``step``) from its first piece: the pieces of one parameter are stepped together.

    Args:
        shards: what :func:`state_of_pieces` returned on each rank.
        shapes: every parameter's shape, in global order.
    """
    by_index: dict[int, list[tuple[int, Any]]] = {}
    for shard in shards:
        for index, start, entry in shard:
            by_index.setdefault(index, []).append((start, entry))
    merged: dict[int, Any] = {}
    for index in sorted(by_index):
        pieces = by_index[index]
        if pieces[0][0] is None:  # held whole
            if len(pieces) > 1:
                raise RuntimeError(f"parameter {index} has state on two ranks")
            merged[index] = pieces[0][1]
            continue
        pieces.sort(key=lambda item: item[0])
        first = pieces[0][1]
        entry = {}
        for key, value in first.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                parts = [e[key].reshape(-1) for _, e in pieces]
                entry[key] = torch.cat(parts).view(shapes[index])
            else:
                entry[key] = value
        merged[index] = entry
    return merged


def pack_param_groups(param_groups: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Param groups as a plain optimizer saves them: hyperparameters plus global numbers."""
    packed = []
    start = 0
    for group in param_groups:
        entry = {k: v for k, v in group.items() if k != "params"}
        entry["params"] = list(range(start, start + len(group["params"])))
        start += len(group["params"])
        packed.append(entry)
    return packed


def select_pieces(state_dict: Mapping[str, Any],
                  pieces_by_group: Sequence[Sequence[tuple[int, Any]]]) -> dict[str, Any]:
    """The local optimizer's state dict, cut out of a full one for this rank's pieces.

    Args:
        state_dict: a full state dict (ours after consolidation, or a plain optimizer's).
        pieces_by_group: for each group, ``(position in the group, piece)`` of what this
            rank steps, in local order.
    """
    state = state_dict["state"]
    local_state: dict[int, Any] = {}
    local_groups: list[dict[str, Any]] = []
    local_index = 0
    for saved, pieces in zip(state_dict["param_groups"], pieces_by_group):
        local_params = []
        # Saved numbers may be any ids; their position is what maps them to parameters.
        for position, piece in pieces:
            saved_id = saved["params"][position]
            if saved_id in state:
                local_state[local_index] = _cut(state[saved_id], piece)
            local_params.append(local_index)
            local_index += 1
        local_groups.append({**hyperparameters(saved), "params": local_params})
    return {"state": local_state, "param_groups": local_groups}


def _cut(entry: Mapping[str, Any], piece: Any) -> dict[str, Any]:
    """A parameter's state for one piece of it: tensors shaped like the parameter are
    sliced (a copy, so that the loaded dict is not stepped in place); the rest stays."""
    if piece.local is piece.param:
        return dict(entry)
    n = piece.local.numel()
    out = {}
    for key, value in entry.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            out[key] = value.reshape(-1)[piece.start : piece.start + n].clone()
        else:
            out[key] = value
    return out
