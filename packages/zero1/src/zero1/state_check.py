"""Checking an optimizer state dict against the optimizer that is to load it, before
anything is changed.

``ShardedOptimizer.load_state_dict`` runs these checks first, so that a state dict of the
wrong type, of another layout or of another optimizer (SGD's state into AdamW) is refused
with a clear error and the optimizer stays exactly as it was, still usable. They need only
the parameters' shapes, so a launcher can also run them on ``meta`` tensors to check a
checkpoint before any rank starts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .param_groups import PARAM_KEYS

# Optimizers whose per-parameter state does not take the parameter's shape (factored
# second moments): their state tensors' shapes are not checked.
_FACTORED = tuple(getattr(torch.optim, name) for name in ("Adafactor",) if hasattr(torch.optim,
                                                                                    name))


def _is_flag(value: Any) -> bool:
    """Option-like hyperparameters (``foreach``, ``fused``, ``maximize``, ...): torch fills
    them in itself when an older state dict lacks them."""
    return value is None or isinstance(value, bool)


def _shape(t: Any) -> list[int]:
    return list(t.shape)


def check_state_dict(
    state_dict: Any,
    param_groups: Sequence[Mapping[str, Any]],
    defaults: Mapping[str, Any],
    *,
    optimizer_name: str = "the optimizer",
    optimizer_cls: type | None = None,
    who: str = "ShardedOptimizer.load_state_dict",
) -> None:
    """Raise unless ``state_dict`` can be loaded by an optimizer with these groups.

    Checks, in order: the type (a mapping with ``state`` and ``param_groups``), the number
    of groups and of parameters in each, that the saved parameter ids are distinct and
    that every ``state`` entry belongs to one of them, that every group carries the
    optimizer's numeric hyperparameters (``betas`` and ``eps`` for AdamW, ``momentum``
    for SGD: a state dict of another optimizer lacks them), and that every state tensor
    is a scalar or has its parameter's shape (and a floating dtype for a floating
    parameter), and that every state value is a tensor or a number (not a list).

    Args:
        state_dict: what is about to be loaded.
        param_groups: the loading optimizer's groups (tensors under ``params``; ``meta``
            tensors are enough).
        defaults: the loading optimizer's ``defaults`` (which hyperparameters it uses).
        optimizer_name: named in the messages (e.g. "AdamW").
        optimizer_cls: the optimizer class, to skip shape checks of factored states.
        who: prefix of every message.

    Raises:
        TypeError: not a mapping, or parts of it of the wrong type.
        ValueError: another layout, another optimizer, or a wrongly shaped state tensor.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"{who}: expected an optimizer state dict (a dict with 'state' and "
            f"'param_groups'), got {type(state_dict).__name__}"
        )
    if not {"state", "param_groups"} <= set(state_dict):
        raise ValueError(
            f"{who}: expected a dict with 'state' and 'param_groups' (an optimizer state "
            f"dict); got keys {sorted(map(str, state_dict))}"
        )
    state, saved_groups = state_dict["state"], state_dict["param_groups"]
    if not isinstance(state, Mapping):
        raise TypeError(f"{who}: 'state' must be a dict keyed by parameter id, got "
                        f"{type(state).__name__}")
    if not isinstance(saved_groups, (list, tuple)):
        raise TypeError(f"{who}: 'param_groups' must be a list of dicts, got "
                        f"{type(saved_groups).__name__}")
    if len(saved_groups) != len(param_groups):
        raise ValueError(
            f"{who}: the state dict has {len(saved_groups)} param groups, "
            f"this optimizer {len(param_groups)}"
        )
    positions: dict[Any, tuple[int, int]] = {}
    required = sorted(k for k, v in defaults.items() if k not in PARAM_KEYS and not _is_flag(v))
    for i, (ours, theirs) in enumerate(zip(param_groups, saved_groups)):
        if not isinstance(theirs, Mapping) or not isinstance(theirs.get("params"), (list, tuple)):
            raise TypeError(f"{who}: param group {i} must be a dict with a 'params' list")
        if len(ours["params"]) != len(theirs["params"]):
            raise ValueError(
                f"{who}: param group {i} has {len(theirs['params'])} "
                f"parameters in the state dict but {len(ours['params'])} here"
            )
        missing = [k for k in required if k not in theirs]
        if missing:
            theirs_keys = sorted(k for k in theirs if k not in PARAM_KEYS)
            raise ValueError(
                f"{who}: param group {i} lacks {', '.join(map(repr, missing))}, which "
                f"{optimizer_name} needs (it has {', '.join(theirs_keys) or 'no options'}): "
                f"the state dict was saved by another optimizer"
            )
        for j, saved_id in enumerate(theirs["params"]):
            try:
                seen = saved_id in positions
            except TypeError:
                raise TypeError(f"{who}: param group {i} lists an unhashable parameter id "
                                f"{saved_id!r}") from None
            if seen:
                raise ValueError(f"{who}: parameter id {saved_id!r} is listed twice")
            positions[saved_id] = (i, j)
    check_shapes = optimizer_cls is None or not issubclass(optimizer_cls, _FACTORED)
    for saved_id, entry in state.items():
        if saved_id not in positions:
            raise ValueError(f"{who}: 'state' has an entry for parameter id {saved_id!r}, "
                             "which no param group lists")
        if not isinstance(entry, Mapping):
            raise TypeError(f"{who}: the state of parameter id {saved_id!r} must be a dict, "
                            f"got {type(entry).__name__}")
        i, j = positions[saved_id]
        param = param_groups[i]["params"][j]
        for key, value in entry.items():
            if value is not None and not isinstance(value, (torch.Tensor, int, float, bool)):
                raise TypeError(
                    f"{who}: state {key!r} of parameter {j} in param group {i} is a "
                    f"{type(value).__name__}; optimizer state values are tensors or numbers")
            if (isinstance(value, torch.Tensor) and value.dim() > 0
                    and param.is_floating_point() and not value.is_floating_point()):
                raise TypeError(
                    f"{who}: state {key!r} of parameter {j} in param group {i} is a "
                    f"{value.dtype} tensor; the parameter is {param.dtype}")
            if not check_shapes or not isinstance(value, torch.Tensor) or value.numel() <= 1:
                continue  # scalars such as 'step'
            if value.shape != param.shape:
                raise ValueError(
                    f"{who}: state {key!r} of parameter {j} in param group {i} has shape "
                    f"{_shape(value)}, the parameter {_shape(param)}"
                )


def dry_run_load(
    state_dict: Mapping[str, Any],
    param_groups: Sequence[Mapping[str, Any]],
    defaults: Mapping[str, Any],
    optimizer_cls: type,
    *,
    who: str = "ShardedOptimizer.load_state_dict",
) -> None:
    """Load the whole ``state_dict`` into a throwaway ``optimizer_cls`` over ``meta``
    copies of the parameters (no memory, no data copied), so that whatever the optimizer
    itself would refuse (AdamW's state without its ``step``) is refused on every rank
    before any rank changes its shard.

    Raises:
        ValueError: the optimizer cannot load this state.
    """
    try:
        groups = [{**{k: v for k, v in g.items() if k not in PARAM_KEYS},
                   "params": [torch.empty_like(p, device="meta") for p in g["params"]]}
                  for g in param_groups]
        try:
            trial = optimizer_cls(groups)  # every hyperparameter is in the groups
        except TypeError:
            trial = optimizer_cls(groups, lr=defaults.get("lr", 1e-3))
    except Exception:  # noqa: BLE001 (an optimizer that cannot live on meta tensors: skip)
        return
    try:
        trial.load_state_dict(dict(state_dict))
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as exc:
        raise ValueError(
            f"{who}: {optimizer_cls.__name__} cannot load this state ({type(exc).__name__}: "
            f"{exc}); the optimizer is unchanged"
        ) from exc
