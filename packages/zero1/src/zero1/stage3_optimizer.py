"""``Stage3Optimizer``: a ``torch.optim`` optimizer over the shards of a model sharded by
:func:`zero1.shard_model` (ZeRO stage 3).

The user passes the model's parameters (or param groups of them) as to any optimizer.
Each parameter is a view of its unit's flat buffer (:mod:`zero1.stage3`); the part of it
that falls in this rank's shard is its *piece*, a 1-D view of the shard, and the local
``optimizer_cls`` steps the pieces, which is exact for an elementwise update (AdamW,
Adam, SGD with momentum, ...). A parameter none of whose elements fall in this rank's
shard has no piece here. ``param_groups`` list the parameters themselves with their
hyperparameters, as in a plain optimizer; ``state`` is the pieces' state. State dicts
are the plain optimizer's full format (:mod:`zero1.checkpoint`), so a checkpoint moves
between world sizes, stages and plain optimizers.

An optimizer that needs whole parameters (Muon, Adafactor) steps each one on its owner
rank instead: at the step, the owner gathers the parameter's gradient and values from
the shards, steps it whole, and sends each rank the new values of its piece
(:mod:`zero1.whole_params`); the owner holds the whole parameter only during the step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from .checkpoint import gather_full_state, load_full_state, pack_param_groups
from .flat import Piece
from .param_groups import (
    PARAM_KEYS,
    check_distinct_and_colocated,
    hyperparameters,
    normalize_new_group,
    normalize_param_groups,
)
from .stage3 import ShardedModel, Unit
from .whole_params import WholeParameters, check_whole_parameter_groups, steps_whole_parameters

#: Optimizers stepped neither piece by piece nor whole on an owner: sparse gradients, one
#: state for every parameter.
_REFUSED = tuple(getattr(torch.optim, name) for name in ("SparseAdam", "LBFGS")
                 if hasattr(torch.optim, name))

_WHO = "Stage3Optimizer"


def _owner(p: torch.Tensor) -> tuple[ShardedModel, Unit, int]:
    info = getattr(p, "_zero1_stage3", None)
    if info is None:
        raise ValueError(f"{_WHO}: a parameter of shape {list(p.shape)} belongs to no model "
                         "sharded by zero1.shard_model; call shard_model(model) first and pass "
                         "model.parameters()")
    return info


def piece_of(p: torch.Tensor) -> Piece | None:
    """This rank's piece of a sharded parameter ``p``: the 1-D view of its unit's shard
    that holds elements ``[start, start + numel)`` of the flattened ``p`` (None when no
    element of ``p`` is in this rank's shard). What a checkpoint that never gathers
    writes and reads."""
    sharded, unit, i = _owner(p)
    off, n = unit.offsets[i], p.numel()
    if unit.alias:
        return Piece(param=p, local=unit.shard[off:off + n], start=0)
    for member, lo, hi in unit.layout.pieces(sharded.rank):
        if member == i:
            base = unit.layout.shard(sharded.rank).start
            return Piece(param=p, local=unit.shard[lo - base:hi - base], start=lo - off)
    return None


class Stage3Optimizer(Optimizer):
    """Steps this rank's shards of a model sharded by :func:`zero1.shard_model`.

    Construction, ``step``, ``clip_grad_norm_`` and ``consolidate_state_dict`` are
    collectives: call them on every rank in the same order.

    Args:
        params: the sharded model's parameters, or param-group dicts of them.
        optimizer_cls: a ``torch.optim.Optimizer`` subclass with an elementwise update
            (AdamW, SGD, ...), or one that steps whole parameters (``zero1.Muon``,
            ``torch.optim.Muon``, Adafactor: each is stepped on its owner rank).
        **defaults: passed to ``optimizer_cls`` (lr, betas, momentum, ...).
    """

    def __init__(self, params: Any, optimizer_cls: type[Optimizer], **defaults: Any) -> None:
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, Optimizer)):
            raise TypeError(f"{_WHO}: optimizer_cls must be a torch.optim.Optimizer subclass, "
                            f"got {optimizer_cls!r}")
        if issubclass(optimizer_cls, (*_REFUSED, Stage3Optimizer)):
            raise TypeError(f"{_WHO}: {optimizer_cls.__name__} cannot step shards of "
                            "parameters (sparse gradients, or one state for all parameters)")
        groups = normalize_param_groups(params, _WHO)
        everything = [p for g in groups for p in g["params"]]
        check_distinct_and_colocated(everything, who=_WHO)
        owners = {id(_owner(p)[0]): _owner(p)[0] for p in everything}
        self._shardings: list[ShardedModel] = list(owners.values())
        self._optimizer_cls = optimizer_cls
        # What this rank holds of each parameter (its gradients, clipping): per group,
        # (position, piece of the shard).
        self._held = [self._pieces_of(g) for g in groups]
        # What the local optimizer steps: the held pieces, or the whole parameters owned.
        self._whole: WholeParameters | None = None
        self._unused: set[int] = set()
        if steps_whole_parameters(optimizer_cls):
            check_whole_parameter_groups(optimizer_cls, groups, defaults)
            first = self._shardings[0]
            self._whole = WholeParameters(first.rank, first.world_size, first.group,
                                          values_held=False)
            self._pieces = self._add_whole(groups)
        else:
            self._pieces = self._held
        local_groups = [{**hyperparameters(g), "params": [pc.local for _, pc in pieces]}
                        for g, pieces in zip(groups, self._pieces)]
        self._local = optimizer_cls(local_groups, **defaults)
        self._consolidated: dict[int, Any] | None = None
        self._constructing = True
        try:
            super().__init__([{**hyperparameters(local), "params": g["params"]}
                              for local, g in zip(self._local.param_groups, groups)],
                             self._local.defaults)
        finally:
            self._constructing = False
        self.state = self._local.state  # type: ignore[assignment]

    @staticmethod
    def _pieces_of(group: Mapping[str, Any]) -> list[tuple[int, Piece]]:
        out = []
        for position, p in enumerate(group["params"]):
            piece = piece_of(p)
            if piece is not None:
                out.append((position, piece))
        return out

    def _add_whole(self, groups: list[dict[str, Any]]) -> list[list[tuple[int, Piece]]]:
        """Owners for the trainable parameters of ``groups``; this rank's owned ones."""
        assert self._whole is not None
        owned = self._whole.add([p for g in groups for p in g["params"] if p.requires_grad])
        spans = {}
        for sharded in self._shardings:
            for unit in sharded.units:
                for p, held in zip(unit.params, unit.layout.spans()):
                    spans[id(p)] = held
        self._whole.set_spans(spans)
        return [[(j, owned[id(p)]) for j, p in enumerate(g["params"]) if id(p) in owned]
                for g in groups]

    @property
    def rank(self) -> int:
        return self._shardings[0].rank

    @property
    def world_size(self) -> int:
        return self._shardings[0].world_size

    @property
    def local_optimizer(self) -> Optimizer:
        """The ``optimizer_cls`` instance stepping this rank's pieces."""
        return self._local

    def owner_of(self, param: torch.Tensor) -> int:
        """The rank that steps ``param`` whole and holds its state (an optimizer that
        needs whole parameters, such as Muon; an elementwise one has no owners).

        Raises:
            ValueError: an elementwise optimizer, or not a trainable parameter here.
        """
        owner = None if self._whole is None else self._whole.owner_of(param)
        if owner is None:
            raise ValueError(f"{_WHO}.owner_of: only the trainable parameters of an optimizer "
                             "that steps whole parameters (Muon) have owners")
        return owner

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of sharded parameters (call it on every rank)."""
        if getattr(self, "_constructing", False):
            super().add_param_group(param_group)
            return
        group = normalize_new_group(param_group, self.param_groups, _WHO)
        for p in group["params"]:
            sharded = _owner(p)[0]
            if all(s is not sharded for s in self._shardings):
                self._shardings.append(sharded)
        held = self._pieces_of(group)
        pieces = held if self._whole is None else self._add_whole([group])[0]
        self._local.add_param_group({**hyperparameters(group),
                                     "params": [pc.local for _, pc in pieces]})
        self._held.append(held)
        if self._whole is not None:
            self._pieces.append(pieces)
        local = self._local.param_groups[-1]
        super().add_param_group({**hyperparameters(local), "params": group["params"]})
        self._consolidated = None

    # -------------------------------------------------------------- gradients
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside keep full-size gradients in the parameters' ``.grad`` and
        send nothing; the next backward outside adds to them and reduce-scatters the sum.
        Costs a full gradient of every parameter (in ``param_dtype``) until then; without
        it each micro-step reduce-scatters (Ψ more sent) into the shard and holds none."""
        with contextlib.ExitStack() as stack:
            for sharded in self._shardings:
                stack.enter_context(sharded.no_sync())
            yield

    def finish_gradient_synchronization(self) -> None:
        """Wait for the reductions and point each piece's ``.grad`` at its averaged
        gradient (None for a parameter no rank gave a gradient). Collective."""
        grads: dict[int, torch.Tensor | None] = {}
        for sharded in self._shardings:
            sharded.finish()
            flags = sharded.used_flags()
            k = 0
            for unit in sharded.units:
                for i in range(len(unit.params)):
                    grads[id(unit.params[i])] = (unit, bool(flags[k + i]))  # type: ignore[assignment]
                k += len(unit.params)
        self._unused = {key for key, (_, used) in grads.items()  # type: ignore[misc]
                        if not used}
        for pieces in self._held:
            for _, piece in pieces:
                unit, used = grads[id(piece.param)]  # type: ignore[misc]
                if not used or unit.grad_shard is None:
                    piece.local.grad = None
                    continue
                base = piece.local.storage_offset() - unit.shard.storage_offset()
                piece.local.grad = unit.grad_shard[base:base + piece.local.numel()]

    def gradient_bytes(self) -> int:
        """Bytes of gradients this rank holds: the averaged shards, and the full gradients
        ``no_sync`` keeps in ``.grad``."""
        total = 0
        for sharded in self._shardings:
            for unit in sharded.units:
                if unit.grad_shard is not None:
                    total += unit.grad_shard.numel() * unit.grad_shard.element_size()
                total += sum(p.grad.numel() * p.grad.element_size() for p in unit.params
                             if p.grad is not None)
        return total

    def shard_gradients(self) -> list[torch.Tensor]:
        """The averaged gradients this rank steps (after the synchronization)."""
        self.finish_gradient_synchronization()
        return [pc.local.grad for pieces in self._held for _, pc in pieces
                if pc.local.grad is not None]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the averaged gradients so that their global norm is at most ``max_norm``
        (as ``torch.nn.utils.clip_grad_norm_`` over the whole parameters); returns the norm
        before clipping. Collective: one all-reduce of a scalar."""
        max_norm, norm_type = float(max_norm), float(norm_type)
        if not max_norm >= 0:
            raise ValueError(f"{_WHO}.clip_grad_norm_: max_norm must be >= 0, got {max_norm}")
        if not norm_type >= 1:
            raise ValueError(f"{_WHO}.clip_grad_norm_: norm_type must be >= 1, got {norm_type}")
        grads = self.shard_gradients()
        device = self._shardings[0].units[0].shard.device
        wide = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
        # One kernel over all the pieces where foreach norms exist (a launch per piece else).
        if grads and hasattr(torch, "_foreach_norm") and all(g.dtype == wide for g in grads):
            norms = list(torch._foreach_norm(grads, norm_type))
        else:
            norms = [torch.linalg.vector_norm(g, norm_type, dtype=wide) for g in grads]
        if norm_type == float("inf"):
            total = torch.stack(norms).max() if norms else torch.zeros((), dtype=wide,
                                                                       device=device)
            op = dist.ReduceOp.MAX
        else:
            total = (torch.stack(norms).pow(norm_type).sum() if norms
                     else torch.zeros((), dtype=wide, device=device))
            op = dist.ReduceOp.SUM
        if self.world_size > 1:
            dist.all_reduce(total, op=op, group=self._shardings[0].group)
        if norm_type != float("inf"):
            total = total.pow(1.0 / norm_type)
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        if grads and all(g.dtype == grads[0].dtype for g in grads):
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        else:
            for g in grads:
                g.mul_(coef.to(g.dtype))
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the averaged gradient shards, and full gradients kept by ``no_sync``."""
        for sharded in self._shardings:
            sharded.zero_grad()
        for pieces in self._held:
            for _, piece in pieces:
                piece.local.grad = None

    # -------------------------------------------------------------- stepping
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:  # type: ignore[override]
        """Step this rank's shards (collective: it synchronizes the gradients first).

        The full parameters are gathered again by the next forward. Whole parameters are
        gathered onto their owners, stepped there, and their new values sent back.

        Raises:
            Whatever the local optimizer's step raised; with whole parameters, after this
            rank has sent its part, so that no rank is left waiting.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.finish_gradient_synchronization()
        for group, local in zip(self.param_groups, self._local.param_groups):
            for key, value in group.items():
                if key not in PARAM_KEYS:
                    local[key] = value
        for sharded in self._shardings:
            sharded.reshard()
        self._consolidated = None
        if self._whole is None:
            self._local.step(**kwargs)
            return loss
        held = {id(pc.param): (pc.local, pc.local.grad) for pieces in self._held
                for _, pc in pieces if pc.param.requires_grad}
        failure = self._whole.step(self._local, held, self._unused, **kwargs)
        if failure is not None:
            raise failure
        return loss

    # -------------------------------------------------------------- checkpoints
    def numbered_pieces(self) -> list[tuple[int, Piece]]:
        """(global parameter number, piece) of every piece this rank steps: ``piece.local``
        is this rank's shard of the flattened ``piece.param`` from ``piece.start`` (its
        values, and the key of the local optimizer's state): what a checkpoint that never
        gathers writes and reads (see :func:`piece_of`)."""
        out, start = [], 0
        for group, pieces in zip(self.param_groups, self._pieces):
            out.extend((start + j, piece) for j, piece in pieces)
            start += len(group["params"])
        return out

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's state onto rank ``to`` (collective; tensors on the CPU);
        then ``state_dict()`` there returns the full state until the next step."""
        group = self._shardings[0].group

        def global_rank(r: int) -> int:
            return dist.get_global_rank(group, r) if group is not None else r

        self._consolidated = gather_full_state(
            self._local.state, self.numbered_pieces(), self.param_groups, to,
            rank=self.rank, world_size=self.world_size, group=group,
            global_rank=global_rank, who=_WHO)

    def state_dict(self) -> dict[str, Any]:
        """The full state in ``optimizer_cls``'s format (after consolidation, on that rank).

        Raises:
            RuntimeError: not consolidated here, or stale.
        """
        if self._consolidated is None:
            raise RuntimeError(f"{_WHO}.state_dict: rank {self.rank} holds no consolidated "
                               "state; call consolidate_state_dict(to=r) on every rank (again "
                               "after any step), then state_dict() on rank r")
        return {"state": dict(self._consolidated),
                "param_groups": pack_param_groups(self.param_groups)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state dict (ours, stage 1/2's or a plain optimizer's), at any world
        size; every rank keeps its pieces' state. Checked whole first: raises and changes
        nothing if it does not fit (a failing load puts the local optimizer back)."""
        load_full_state(state_dict, self.param_groups, self.defaults, self._local,
                        self._pieces, who=_WHO)
        self.state = self._local.state  # type: ignore[assignment]
        self._consolidated = None

    def __repr__(self) -> str:
        return (f"Stage3Optimizer({self._optimizer_cls.__name__}, rank {self.rank} of "
                f"{self.world_size}, {len(self.param_groups)} param groups)")
