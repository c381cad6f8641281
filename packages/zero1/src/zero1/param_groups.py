"""Checking and normalising what users pass as ``params``, before anything is sharded.

Every check here but the last is local and deterministic, so given the same inputs every
rank raises the same error before the first collective, and nothing hangs. The last,
:func:`check_same_on_every_rank`, is the first collective: it catches ranks given
different inputs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from minddp import ModelMismatchError

from .group import GroupInfo

# Group keys that describe the parameters themselves, not hyperparameters.
PARAM_KEYS = ("params", "param_names")

#: The optimizer named in error messages, unless a caller names another (``who``).
_WHO = "ShardedOptimizer"


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A group's entries other than its parameters (lr, betas, weight_decay, ...)."""
    return {k: v for k, v in group.items() if k not in PARAM_KEYS}


def _group_params(raw: Any, where: str, who: str = _WHO) -> list[torch.Tensor]:
    """The parameters of one group as a list, with every element checked."""
    if isinstance(raw, torch.Tensor):
        # torch.optim accepts a single tensor as a group's "params"; so do we.
        return [raw]
    if isinstance(raw, (set, frozenset)):
        raise TypeError(
            f"{who}: {where} 'params' is a set; sets have no stable order across "
            "processes, so every rank could shard differently. Pass a list."
        )
    if isinstance(raw, dict) or not isinstance(raw, Iterable):
        raise TypeError(
            f"{who}: {where} 'params' must be an iterable of tensors, got {type(raw).__name__}"
        )
    params = list(raw)
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            hint = ""
            if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):
                hint = " (named parameters are not supported; pass model.parameters())"
            raise TypeError(
                f"{who}: {where} element {i} is a {type(p).__name__}, not a torch.Tensor{hint}"
            )
        if p.is_sparse:
            raise TypeError(f"{who}: {where} element {i} is a sparse tensor; only dense ones")
    return params


def normalize_group(group: Any, where: str = "param group", who: str = _WHO) -> dict[str, Any]:
    """A shallow copy of one param-group dict with ``params`` as a checked list."""
    if not isinstance(group, dict):
        raise TypeError(f"{who}: a param group must be a dict, got {type(group).__name__}")
    if "params" not in group:
        raise ValueError(f"{who}: {where} has no 'params' entry")
    out = {k: v for k, v in group.items() if k != "param_names"}
    out["params"] = _group_params(group["params"], where, who)
    return out


def normalize_param_groups(params: Any, who: str = _WHO) -> list[dict[str, Any]]:
    """Turn ``params`` (tensors or param-group dicts) into a list of group dicts.

    Args:
        params: an iterable of tensors, or of dicts each with a ``params`` entry.

    Raises:
        TypeError: a bare tensor, a non-iterable, a set, or elements of the wrong type.
        ValueError: no parameters at all.
    """
    if isinstance(params, torch.Tensor):
        raise TypeError(
            f"{who}: params must be an iterable of tensors or param-group dicts, but got a "
            f"single {torch.typename(params)}; wrap it in a list: [tensor]"
        )
    if isinstance(params, (set, frozenset)):
        raise TypeError(f"{who}: params is a set, whose order differs across processes; "
                        "pass a list")
    if isinstance(params, dict) or not isinstance(params, Iterable):
        raise TypeError(
            f"{who}: params must be an iterable of tensors or param-group dicts, got "
            f"{type(params).__name__}"
        )
    items = list(params)
    if not items:
        raise ValueError(f"{who}: got an empty parameter list")
    if all(isinstance(item, dict) for item in items):
        groups = [normalize_group(g, f"param group {i}", who) for i, g in enumerate(items)]
    elif any(isinstance(item, dict) for item in items):
        raise TypeError(f"{who}: params mixes param-group dicts with other items")
    else:
        groups = [{"params": _group_params(items, "params", who)}]
    if sum(len(g["params"]) for g in groups) == 0:
        raise ValueError(f"{who}: got an empty parameter list (every param group is empty)")
    return groups


def check_distinct_and_colocated(
    new: Sequence[torch.Tensor], existing: Sequence[torch.Tensor] = (), who: str = _WHO
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
                f"{who}: parameter {i} (shape {tuple(p.shape)}) appears more than once "
                "(in one group or across groups); each parameter may be listed only once"
            )
        seen.add(id(p))
    devices = {p.device for p in (*existing, *new)}
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(
            f"{who}: parameters are on mixed devices ({names}); every parameter must be "
            "on this rank's one device"
        )


def normalize_new_group(param_group: Any, param_groups: Sequence[dict[str, Any]],
                        who: str = _WHO) -> dict[str, Any]:
    """:func:`normalize_group` for ``add_param_group``: also rejects a parameter already in
    ``param_groups`` (the optimizer's groups), or on another device than theirs."""
    group = normalize_group(param_group, who=who)
    existing = [p for g in param_groups for p in g["params"]]
    check_distinct_and_colocated(group["params"], existing, who)
    return group


class ParameterMismatchError(ModelMismatchError, ValueError):
    """Ranks passed parameters that differ: in number, shape, dtype, ``requires_grad`` or
    initial values (a :class:`minddp.ModelMismatchError`, and a ``ValueError``)."""


def _checksums(params: Sequence[torch.Tensor]) -> list[str]:
    """A float64 sum of each parameter's values, as text (NaN compares equal to NaN)."""
    sums = []
    for p in params:
        t = p.detach()
        if t.is_complex():
            t = torch.view_as_real(t)
        if t.device.type == "meta" or t.numel() == 0:
            sums.append(torch.zeros((), dtype=torch.float64))
        else:
            sums.append(torch.sum(t, dtype=torch.float64).cpu())
    return [float(x).hex() for x in torch.stack(sums).tolist()] if sums else []


def _signature(groups: Sequence[Sequence[torch.Tensor]]) -> list[tuple]:
    """Per parameter: (group, position, shape, dtype, requires_grad, checksum)."""
    flat = [(i, j, p) for i, params in enumerate(groups) for j, p in enumerate(params)]
    sums = _checksums([p for _, _, p in flat])
    return [(i, j, tuple(p.shape), str(p.dtype), p.requires_grad, c)
            for (i, j, p), c in zip(flat, sums)]


def _difference(a: list[tuple], b: list[tuple]) -> str:
    names = ("shape", "dtype", "requires_grad", "initial values (a float64 sum)")
    for x, y in zip(a, b):
        for name, u, v in zip(names, x[2:], y[2:]):
            if u != v:
                if name.startswith("initial"):
                    u, v = float.fromhex(u), float.fromhex(v)
                return f"parameter {x[1]} of param group {x[0]}: {name} {u} vs {v}"
    return f"{len(a)} parameters vs {len(b)}"


def check_same_on_every_rank(info: GroupInfo, groups: Sequence[Sequence[torch.Tensor]],
                             what: str) -> None:
    """Collective: raise :class:`ParameterMismatchError` on every rank unless all ranks
    pass the same parameters, in the same order, with the same initial values.

    Ranks given different parameters would issue different collectives (a crash) or
    shard one parameter's state into another's (silent divergence). The values are
    compared by a checksum each, which also catches same-shaped parameters passed in
    another order (not ones whose values are identical, such as two zero biases).
    """
    if info.world_size == 1:
        return
    mine = _signature(groups)
    everyone: list[Any] = [None] * info.world_size
    dist.all_gather_object(everyone, mine, group=info.group)
    differing = [r for r, sig in enumerate(everyone) if sig != everyone[0]]
    if differing:
        raise ParameterMismatchError(
            f"ShardedOptimizer.{what}: ranks {differing} passed parameters that differ from "
            f"rank 0's (rank {differing[0]}: {_difference(everyone[0], everyone[differing[0]])})"
            "; every rank must pass the same parameters, in the same order, with the same "
            "values and requires_grad flags")
