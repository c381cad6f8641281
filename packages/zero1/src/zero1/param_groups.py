"""Checking and normalising what users pass as ``params``, before anything is sharded.

Every check here but the last is local and deterministic, so given the same inputs every
rank raises the same error before the first collective, and nothing hangs. The last,
:func:`check_same_on_every_rank`, is the first collective: it catches ranks given
different inputs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .sharded_optimizer import GroupInfo

# Group keys that describe the parameters themselves, not hyperparameters.
PARAM_KEYS = ("params", "param_names")

_WHO = "ShardedOptimizer"


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A group's entries other than its parameters (lr, betas, weight_decay, ...)."""
    return {k: v for k, v in group.items() if k not in PARAM_KEYS}


def _group_params(raw: Any, where: str) -> list[torch.Tensor]:
    """The parameters of one group as a list, with every element checked."""
    if isinstance(raw, torch.Tensor):
        # torch.optim accepts a single tensor as a group's "params"; so do we.
        return [raw]
    if isinstance(raw, (set, frozenset)):
        raise TypeError(
            f"{_WHO}: {where} 'params' is a set; sets have no stable order across "
            "processes, so every rank could shard differently. Pass a list."
        )
    if isinstance(raw, dict) or not isinstance(raw, Iterable):
        raise TypeError(
            f"{_WHO}: {where} 'params' must be an iterable of tensors, got {type(raw).__name__}"
        )
    params = list(raw)
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            hint = ""
            if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):
                hint = " (named parameters are not supported; pass model.parameters())"
            raise TypeError(
                f"{_WHO}: {where} element {i} is a {type(p).__name__}, not a torch.Tensor{hint}"
            )
        if p.is_sparse:
            raise TypeError(f"{_WHO}: {where} element {i} is a sparse tensor; only dense ones")
    return params


def normalize_group(group: Any, where: str = "param group") -> dict[str, Any]:
    """A shallow copy of one param-group dict with ``params`` as a checked list."""
    if not isinstance(group, dict):
        raise TypeError(f"{_WHO}: a param group must be a dict, got {type(group).__name__}")
    if "params" not in group:
        raise ValueError(f"{_WHO}: {where} has no 'params' entry")
    out = {k: v for k, v in group.items() if k != "param_names"}
    out["params"] = _group_params(group["params"], where)
    return out


def normalize_param_groups(params: Any) -> list[dict[str, Any]]:
    """Turn ``params`` (tensors or param-group dicts) into a list of group dicts.

    Args:
        params: an iterable of tensors, or of dicts each with a ``params`` entry.

    Raises:
        TypeError: a bare tensor, a non-iterable, a set, or elements of the wrong type.
        ValueError: no parameters at all.
    """
    if isinstance(params, torch.Tensor):
        raise TypeError(
            f"{_WHO}: params must be an iterable of tensors or param-group dicts, but got a "
            f"single {torch.typename(params)}; wrap it in a list: [tensor]"
        )
    if isinstance(params, (set, frozenset)):
        raise TypeError(f"{_WHO}: params is a set, whose order differs across processes; "
                        "pass a list")
    if isinstance(params, dict) or not isinstance(params, Iterable):
        raise TypeError(
            f"{_WHO}: params must be an iterable of tensors or param-group dicts, got "
            f"{type(params).__name__}"
        )
    items = list(params)
    if not items:
        raise ValueError(f"{_WHO}: got an empty parameter list")
    if all(isinstance(item, dict) for item in items):
        groups = [normalize_group(g, f"param group {i}") for i, g in enumerate(items)]
    elif any(isinstance(item, dict) for item in items):
        raise TypeError(f"{_WHO}: params mixes param-group dicts with other items")
    else:
        groups = [{"params": _group_params(items, "params")}]
    if sum(len(g["params"]) for g in groups) == 0:
        raise ValueError(f"{_WHO}: got an empty parameter list (every param group is empty)")
    return groups


def check_distinct_and_colocated(
    new: Sequence[torch.Tensor], existing: Sequence[torch.Tensor] = ()
) -> None:
    """Reject a parameter listed twice, and parameters on more than one device.

    Args:
        new: parameters being added.
        existing: parameters already in the optimizer.

    Raises:
        ValueError: naming the duplicate position or the devices found.
    """
    seen = {id(p) for p in existing}
    for i, p in enumerate(new):
        if id(p) in seen:
            raise ValueError(
                f"{_WHO}: parameter {i} (shape {tuple(p.shape)}) appears more than once "
                "(in one group or across groups); each parameter may be listed only once"
            )
        seen.add(id(p))
    devices = {p.device for p in (*existing, *new)}
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(
            f"{_WHO}: parameters are on mixed devices ({names}); every parameter must be "
            "on this rank's one device"
        )


def layout_fingerprint(groups: Sequence[Sequence[torch.Tensor]]) -> str:
    """A short digest of every group's parameter shapes and dtypes."""
    text = repr([[(tuple(p.shape), str(p.dtype)) for p in params] for params in groups])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_same_on_every_rank(info: GroupInfo, groups: Sequence[Sequence[torch.Tensor]],
                             what: str) -> None:
    """Collective: raise ValueError on every rank unless all ranks pass the same layout.

    The partition is computed locally, so ranks given different parameters would
    disagree on who owns what and then deadlock or corrupt each other's weights.
    """
    if info.world_size == 1:
        return
    mine = layout_fingerprint(groups)
    everyone: list[Any] = [None] * info.world_size
    dist.all_gather_object(everyone, mine, group=info.group)
    differing = [r for r, fp in enumerate(everyone) if fp != everyone[0]]
    if differing:
        raise ValueError(
            f"ShardedOptimizer.{what}: ranks {differing} passed parameters whose shapes or "
            "dtypes differ from rank 0's; every rank must pass the same parameters"
        )
