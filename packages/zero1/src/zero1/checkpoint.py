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


def shard_state_by_global_index(
    state: Mapping[torch.Tensor, Any], owned: Sequence[tuple[int, torch.Tensor]]
) -> dict[int, Any]:
    """A shard's state on the CPU, keyed by global parameter number.

    Reads ``state`` for the owned parameters only: ``optimizer.state`` is a
    defaultdict, and code that merely looked up another rank's parameter left an
    empty entry for it here, which must not reach the checkpoint.

    Args:
        state: the local optimizer's ``state`` (keyed by parameter).
        owned: ``(global number, parameter)`` for each parameter this rank owns.
    """
    return {index: to_cpu(state[p]) for index, p in owned if state.get(p)}


def merge_shards(shards: Sequence[Mapping[int, Any]]) -> dict[int, Any]:
    """One ``state`` mapping from every rank's shard, in global parameter order."""
    merged: dict[int, Any] = {}
    for shard in shards:
        for index, entry in shard.items():
            if index in merged:
                raise RuntimeError(f"parameter {index} has state on two ranks")
            merged[index] = entry
    return dict(sorted(merged.items()))


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


def select_shard(
    state_dict: Mapping[str, Any],
    owners_by_group: Sequence[Sequence[int]],
    rank: int,
) -> dict[str, Any]:
    """The local optimizer's state dict for ``rank``, cut out of a full one.

    Args:
        state_dict: a full state dict (ours after consolidation, or a plain optimizer's).
        owners_by_group: for each group, the owning rank of each of its parameters.
        rank: the rank whose shard to keep.
    """
    state = state_dict["state"]
    local_state: dict[int, Any] = {}
    local_groups: list[dict[str, Any]] = []
    local_index = 0
    for saved, owners in zip(state_dict["param_groups"], owners_by_group):
        local_params = []
        # Saved numbers may be any ids; their position is what maps them to parameters.
        for saved_id, owner in zip(saved["params"], owners):
            if owner != rank:
                continue
            if saved_id in state:
                local_state[local_index] = state[saved_id]
            local_params.append(local_index)
            local_index += 1
        local_groups.append({**hyperparameters(saved), "params": local_params})
    return {"state": local_state, "param_groups": local_groups}
