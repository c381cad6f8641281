"""The optimizer's checkpoint: converting between shard state and the full state dict of
a plain optimizer, and checking a state dict before it is loaded.

A plain ``torch.optim`` state dict numbers parameters 0, 1, 2, ... through the groups
in order, keys ``state`` by those numbers, and lists them under each group's
``params``. A shard's local optimizer numbers only its own parameters; these helpers
translate with the list ``local_to_global`` (the global number of each local one).

``ShardedOptimizer`` and ``Stage3Optimizer`` share :func:`gather_full_state` and
:func:`load_full_state`; loading runs the checks (:func:`check_state_dict`,
:func:`dry_run_load`) first, so that a state dict of the wrong type, of another layout or
of another optimizer (SGD's state into AdamW) is refused with a clear error and the
optimizer stays exactly as it was, still usable. They need only the parameters' shapes,
so a launcher can also run them on ``meta`` tensors to check a checkpoint before any rank
starts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .param_groups import PARAM_KEYS, hyperparameters


# ------------------------------------------------------------------ state dicts
def to_cpu(value: Any) -> Any:
    """A copy of ``value`` with every tensor inside it moved to the CPU (for sending)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


def _is_whole(piece: Any) -> bool:
    """Whether ``piece`` covers its whole parameter in the parameter's shape (the
    parameter itself, or what an owner steps of a whole parameter)."""
    return piece.local is piece.param or (piece.start == 0
                                          and piece.local.shape == piece.param.shape)


def state_of_pieces(state: Mapping[torch.Tensor, Any],
                    numbered: Sequence[tuple[int, Any]]) -> list[tuple[int, int | None, Any]]:
    """A rank's state on the CPU, as ``(global number, start, state)`` per piece; start is
    None for a parameter held whole (its state keeps its own shapes, factored ones too).

    Reads ``state`` for the given pieces only: ``optimizer.state`` is a defaultdict, and
    code that merely looked up another tensor left an empty entry for it, which must not
    reach the checkpoint.

    Args:
        state: the local optimizer's ``state`` (keyed by the pieces' local tensors).
        numbered: ``(global parameter number, piece)`` for each piece this rank holds
            (:class:`zero1.flat.Piece`).
    """
    return [(index, None if _is_whole(piece) else piece.start,
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
    sliced (a copy, so that the loaded dict is not stepped in place), unless the piece is
    the whole parameter (a whole parameter stepped by its owner: its state is copied as it
    is, factored statistics too); the rest stays."""
    if piece.local is piece.param:
        return dict(entry)
    n = piece.local.numel()
    out = {}
    for key, value in entry.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            out[key] = (value.clone() if _is_whole(piece)
                         else value.reshape(-1)[piece.start : piece.start + n].clone())
        else:
            out[key] = value
    return out


# ------------------------------------------------------------------ checks before loading
# Optimizers whose per-parameter state does not take the parameter's shape (factored
# second moments): their state tensors' shapes are not checked.
_FACTORED = tuple(getattr(torch.optim, name) for name in ("Adafactor",) if hasattr(torch.optim,
                                                                                    name))


def _is_flag(value: Any) -> bool:
    """Option-like hyperparameters (``foreach``, ``fused``, ``maximize``, Muon's
    ``ns_dtype``, ...): the optimizer fills them in itself when a state dict lacks them
    (``torch.optim.Muon``'s has no ``ns_dtype``)."""
    return value is None or isinstance(value, (bool, torch.dtype))


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


# ------------------------------------------------------------------ gathering and loading
def gather_full_state(
    local_state: Mapping[torch.Tensor, Any],
    numbered: Sequence[tuple[int, Any]],
    param_groups: Sequence[Mapping[str, Any]],
    to: Any,
    *,
    rank: int,
    world_size: int,
    group: dist.ProcessGroup | None,
    global_rank: Callable[[int], int],
    who: str,
) -> dict[int, Any] | None:
    """Gather every rank's piece state onto rank ``to`` and merge it (collective; tensors
    on the CPU): the full ``state`` on rank ``to``, None on the others.

    Args:
        local_state: this rank's local optimizer ``state``.
        numbered: ``(global parameter number, piece)`` of every piece this rank holds.
        param_groups: the optimizer's groups (every parameter, for their shapes).
        to: the rank in ``group`` that receives the state (checked here).
        rank, world_size: this process's rank in ``group`` and the group's size.
        group: the process group (None: the default one).
        global_rank: the global rank of a rank in ``group``.
        who: the class named in messages (e.g. "ShardedOptimizer").

    Raises:
        ValueError: ``to`` is not a rank in the group.
    """
    if not isinstance(to, int) or not 0 <= to < world_size:
        raise ValueError(f"{who}.consolidate_state_dict: to must be a rank in "
                         f"[0, {world_size}), got {to!r}")
    shard = state_of_pieces(local_state, numbered)
    if world_size == 1:
        shards: Any = [shard]
    else:
        shards = [None] * world_size if rank == to else None
        dist.gather_object(shard, shards, dst=global_rank(to), group=group)
    if rank != to:
        return None
    params = [p for g in param_groups for p in g["params"]]
    return merge_pieces(shards, [p.shape for p in params])


def load_full_state(
    state_dict: Mapping[str, Any],
    param_groups: Sequence[dict[str, Any]],
    defaults: Mapping[str, Any],
    local: torch.optim.Optimizer,
    pieces_by_group: Sequence[Sequence[tuple[int, Any]]],
    *,
    who: str,
) -> None:
    """Load a full state dict into a sharded optimizer: check it whole
    (:func:`check_state_dict`, :func:`dry_run_load`), load this rank's pieces of it into
    the local optimizer (put back as it was if that fails), then copy the saved
    hyperparameters into ``param_groups``. Changes nothing unless it all fits.

    Args:
        state_dict: a full state dict (ours after consolidation, or a plain optimizer's).
        param_groups: the sharded optimizer's groups (every parameter; updated in place).
        defaults: the sharded optimizer's ``defaults``.
        local: the local optimizer that steps this rank's pieces.
        pieces_by_group: for each group, ``(position in the group, piece)`` of what this
            rank steps, in local order.
        who: the class named in messages (e.g. "Stage3Optimizer").

    Raises:
        TypeError: not a state dict, or parts of it of the wrong type.
        ValueError: another layout or optimizer, or state the optimizer cannot load.
    """
    optimizer_cls = type(local)
    name = f"{who}.load_state_dict"
    check_state_dict(state_dict, param_groups, defaults, optimizer_name=optimizer_cls.__name__,
                     optimizer_cls=optimizer_cls, who=name)
    dry_run_load(state_dict, param_groups, defaults, optimizer_cls, who=name)
    shard = select_pieces(state_dict, pieces_by_group)
    saved_hyperparameters = [hyperparameters(g) for g in state_dict["param_groups"]]
    before = {k: local.__dict__[k] for k in ("state", "param_groups")}
    try:
        local.load_state_dict(shard)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        # torch.optim may have replaced the state before failing: put it back.
        local.__dict__.update(before)
        raise ValueError(
            f"{name}: {optimizer_cls.__name__} cannot load this state "
            f"({type(exc).__name__}: {exc}); the optimizer is unchanged"
        ) from exc
    except BaseException:
        local.__dict__.update(before)
        raise
    for group, saved, filled in zip(param_groups, saved_hyperparameters, local.param_groups):
        params = group["params"]
        group.clear()
        group.update(saved)
        # What the optimizer filled in itself for a state dict that lacks it (an option
        # added since, Muon's ns_dtype in torch.optim.Muon's state dict).
        for key, value in hyperparameters(filled).items():
            group.setdefault(key, value)
        group["params"] = params
