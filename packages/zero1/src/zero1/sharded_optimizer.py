"""``ShardedOptimizer``: ZeRO stages 1 and 2 around a ``torch.optim`` optimizer.

``reduce_gradients=True`` (the default) averages the gradients itself in flat buckets
(:mod:`zero1.buckets`): 2Ψ per step. An elementwise optimizer (AdamW, SGD, ...) steps
each rank's shard; one that needs whole parameters (Muon, Adafactor) steps each on its
owner, which gathers it from the shards and sends the new values back
(:mod:`zero1.whole_params`). ``reduce_gradients=False`` steps whole parameters after a
DDP wrapper's all-reduce and broadcasts them (:mod:`zero1.exchange`): 3Ψ.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from minddp import validate_bucket_rule, validate_bucket_size_mb

from .buckets import COLLECTIVES, ShardedBuckets
from .checkpoint import (
    check_state_dict,
    gather_full_state,
    load_full_state,
    merge_pieces,
    pack_param_groups,
    select_pieces,
    state_of_pieces,
)
from .exchange import ParameterExchange, partition_parameters
from .flat import Piece
from .group import resolve_group
from .param_groups import (
    PARAM_KEYS,
    check_distinct_and_colocated,
    check_same_on_every_rank,
    hyperparameters,
    normalize_new_group,
    normalize_param_groups,
)
from .whole_params import WholeParameters, check_whole_parameter_groups, steps_whole_parameters


# ------------------------------------------------------------------ state size
def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def optimizer_state_numel(optimizer: torch.optim.Optimizer) -> int:
    """Elements in every tensor of ``optimizer.state`` (step counters included).

    Args:
        optimizer: any ``torch.optim.Optimizer``; for a ``ShardedOptimizer`` this is
            the local shard only.
    """
    return sum(t.numel() for t in _tensors(dict(optimizer.state)))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes in every tensor of ``optimizer.state`` (step counters included).

    Args:
        optimizer: any ``torch.optim.Optimizer``; for a ``ShardedOptimizer`` this is
            the local shard only.
    """
    return sum(t.numel() * t.element_size() for t in _tensors(dict(optimizer.state)))


# ------------------------------------------------------------------ the optimizer
#: Optimizers of sparse gradients: the bucket path, which packs dense gradients, refuses
#: them; the broadcast path takes them.
_SPARSE = tuple(getattr(torch.optim, name) for name in ("SparseAdam",)
                if hasattr(torch.optim, name))


def _size(p: torch.Tensor) -> int:
    """Partition weight: bytes, since state tensors usually take the parameter's dtype."""
    return p.numel() * p.element_size()


class ShardedOptimizer(Optimizer):
    """Shards the state of ``optimizer_cls`` over the ranks of a process group (ZeRO).

    With ``reduce_gradients=True`` (default) it also averages the gradients (no DDP
    wrapper): reduce-scattered in flat buckets during backward, each rank steps its
    shard, then the parameters are all-gathered. ``.grad`` is then *not* the average
    (stage 1: the local gradient; stage 2: None): clip with :meth:`clip_grad_norm_`.
    An optimizer that needs whole parameters (Muon, Adafactor) keeps the same buckets,
    and each parameter is stepped whole by its owner rank (:mod:`zero1.whole_params`).
    With ``reduce_gradients=False`` (stage 1) a DDP wrapper averages, and each rank
    steps and broadcasts the whole parameters it owns.

    ``param_groups`` lists every parameter, as in a plain optimizer (schedulers edit it);
    ``state`` is this rank's shard. Construction, ``step``, ``clip_grad_norm_``,
    ``add_param_group`` and ``consolidate_state_dict`` are collectives. Without an
    initialised ``torch.distributed`` it is the plain optimizer.

    Args:
        params: an iterable of tensors or of param-group dicts (not a bare tensor).
        optimizer_cls: a ``torch.optim.Optimizer`` subclass whose state is per parameter:
            elementwise (AdamW, Adam, SGD, ...) or whole-parameter (``zero1.Muon``,
            ``torch.optim.Muon``, Adafactor); with ``reduce_gradients`` not SparseAdam.
        stage: 1 (shard the optimizer state) or 2 (also the gradients; needs
            ``reduce_gradients``).
        reduce_gradients: average the gradients here (see above).
        bucket_size_mb: gradient bucket size in MiB (None: one bucket per dtype).
        bucket_rule: "reach" (a bucket closes once it holds ``bucket_size_mb``) or
            "at_most" (none passes it); minddp's rules.
        reduce_dtype: the dtype gradients travel and are averaged in (e.g.
            ``torch.bfloat16``); None: their own.
        collectives: "tensor" (a reduce-scatter and an all-gather per bucket), "rooted"
            (:mod:`zero1.rooted`, for Gloo) or "auto" (rooted on Gloo).
        process_group: the group to shard over; the default group when None.
        **defaults: passed to ``optimizer_cls`` (lr, betas, momentum, ...).
    """

    def __init__(
        self,
        params: Any,
        optimizer_cls: type[Optimizer],
        *,
        stage: int = 1,
        reduce_gradients: bool = True,
        bucket_size_mb: float | None = 25.0,
        bucket_rule: str = "reach",
        reduce_dtype: torch.dtype | None = None,
        collectives: str = "auto",
        process_group: dist.ProcessGroup | None = None,
        **defaults: Any,
    ) -> None:
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, Optimizer)):
            raise TypeError(
                "ShardedOptimizer: optimizer_cls must be a torch.optim.Optimizer subclass "
                f"(e.g. torch.optim.AdamW), got {optimizer_cls!r}"
            )
        if issubclass(optimizer_cls, ShardedOptimizer):
            raise TypeError("ShardedOptimizer: optimizer_cls cannot be ShardedOptimizer itself")
        if issubclass(optimizer_cls, torch.optim.LBFGS):
            # Its state lives on the first parameter and covers all of them.
            raise TypeError("ShardedOptimizer: LBFGS keeps one state for all parameters, so it "
                            "cannot be sharded by parameter")
        if stage not in (1, 2) or isinstance(stage, bool):
            raise ValueError(f"ShardedOptimizer: stage must be 1 or 2, got {stage!r}")
        if not isinstance(reduce_gradients, bool):
            raise TypeError(f"ShardedOptimizer: reduce_gradients must be a bool, "
                            f"got {reduce_gradients!r}")
        if stage == 2 and not reduce_gradients:
            raise ValueError("ShardedOptimizer: stage 2 shards the gradients, so it reduces "
                             "them itself: reduce_gradients=False needs stage=1")
        if reduce_gradients and issubclass(optimizer_cls, _SPARSE):
            raise TypeError(
                f"ShardedOptimizer: {optimizer_cls.__name__} takes sparse gradients, which the "
                "buckets do not carry; use reduce_gradients=False (whole parameters, with a "
                "DDP wrapper averaging the gradients)")
        if collectives not in COLLECTIVES:
            raise ValueError(f"ShardedOptimizer: collectives must be one of "
                             f"{', '.join(COLLECTIVES)}, got {collectives!r}")
        if reduce_dtype is not None and not (isinstance(reduce_dtype, torch.dtype)
                                             and reduce_dtype.is_floating_point):
            raise TypeError(f"ShardedOptimizer: reduce_dtype must be a floating torch.dtype "
                            f"or None, got {reduce_dtype!r}")
        bucket_size_mb = validate_bucket_size_mb(bucket_size_mb)
        validate_bucket_rule(bucket_rule)
        groups = normalize_param_groups(params)
        check_distinct_and_colocated([p for g in groups for p in g["params"]])
        whole = steps_whole_parameters(optimizer_cls)
        if whole:  # what it refuses (Muon: a 1-D parameter), on every rank, before sending
            check_whole_parameter_groups(optimizer_cls, groups, defaults)
        self._info = resolve_group(process_group)
        check_same_on_every_rank(self._info, [g["params"] for g in groups], "__init__")

        self._optimizer_cls = optimizer_cls
        self.stage = stage
        self.reduce_gradients = reduce_gradients
        self._loads = [0] * self._info.world_size
        self._owners: list[list[int]] = []  # broadcast path: per group, each param's owner
        self._exchange: ParameterExchange | None = None
        self._buckets: ShardedBuckets | None = None
        self._whole: WholeParameters | None = None  # owners of whole parameters, if needed
        self._spans_version = -1  # the bucket layout the owners' exchange follows
        if reduce_gradients and self._info.world_size > 1:
            self._buckets = ShardedBuckets(self._info, stage, bucket_size_mb, bucket_rule,
                                           reduce_dtype, collectives)
            if whole:
                self._whole = WholeParameters(self._info.rank, self._info.world_size,
                                              self._info.group, values_held=True)
        # Per group, this rank's pieces: (position in the group, piece).
        self._pieces: list[list[tuple[int, Piece]]] = self._shard(groups)

        local_groups = [{**hyperparameters(group),
                         "params": [piece.local for _, piece in pieces]}
                        for group, pieces in zip(groups, self._pieces)]
        # An optimizer accepts empty groups, so a rank owning nothing still keeps one
        # local group per global group and the two lists stay aligned.
        self._local = optimizer_cls(local_groups, **defaults)

        # Our groups take the local optimizer's filled-in hyperparameters, so both agree.
        full_groups = [
            {**hyperparameters(local), "params": group["params"]}
            for local, group in zip(self._local.param_groups, groups)
        ]
        self._constructing = True
        super().__init__(full_groups, dict(self._local.defaults))
        self._constructing = False
        self.state = self._local.state  # type: ignore[assignment]
        self._consolidated_state: dict[int, Any] | None = None
        self._rebuild_exchange()

    # ------------------------------------------------------------------ introspection
    @property
    def rank(self) -> int:
        """This process's rank in the sharding group."""
        return self._info.rank

    @property
    def world_size(self) -> int:
        """Number of ranks the state is sharded over."""
        return self._info.world_size

    @property
    def local_optimizer(self) -> Optimizer:
        """The ``optimizer_cls`` instance that holds and steps this rank's shard."""
        return self._local

    @property
    def broadcasts_per_step(self) -> int:
        """Broadcasts one ``step`` issues (broadcast path; 0 otherwise)."""
        return 0 if self._exchange is None else self._exchange.broadcasts_per_step

    @property
    def num_buckets(self) -> int:
        """Gradient buckets of the reduce-scatter path (0 otherwise): each step issues one
        reduce-scatter and one all-gather per bucket, and one small all-reduce."""
        return 0 if self._buckets is None else len(self._buckets.buckets)

    def owner_of(self, param: torch.Tensor) -> int:
        """The rank that owns ``param``'s optimizer state (broadcast path, one rank, or an
        optimizer that steps whole parameters)."""
        if self._whole is not None:
            owner = self._whole.owner_of(param)
            if owner is None:
                raise ValueError("ShardedOptimizer.owner_of: the tensor is not one of the "
                                 "trainable parameters")
            return owner
        if self._buckets is not None:
            raise ValueError("ShardedOptimizer.owner_of: with reduce_gradients every rank owns "
                             "a piece of each bucket, not whole parameters")
        for group, owners in zip(self.param_groups, self._owners):
            for p, owner in zip(group["params"], owners):
                if p is param:
                    return owner
        raise ValueError("ShardedOptimizer.owner_of: the tensor is not one of the parameters")

    def local_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (its shard only)."""
        return optimizer_state_bytes(self._local)

    def gradient_bytes(self) -> int:
        """Bytes of gradient storage held for this rank now: the parameters' ``.grad`` and
        the reduce-scatter path's buffers (each storage counted once)."""
        tensors = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if self._buckets is not None:
            tensors += self._buckets.buffers()
        storages = {}
        for t in tensors:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    # ------------------------------------------------------------------ sharding
    def _shard(self, groups: list[dict[str, Any]]) -> list[list[tuple[int, Piece]]]:
        """This rank's pieces of ``groups`` (new groups: their parameters are not sharded
        yet). Collective on the reduce-scatter path (parameters broadcast from rank 0)."""
        if self._buckets is not None:
            trainable = [p for g in groups for p in g["params"] if p.requires_grad]
            self._buckets.add(trainable)
            if self._whole is not None:  # whole parameters, on their owners
                owned = self._whole.add(trainable)
                return [[(j, owned[id(p)]) for j, p in enumerate(g["params"]) if id(p) in owned]
                        for g in groups]
            return self._bucket_pieces(groups)
        out = []
        for group in groups:
            owners, self._loads = partition_parameters(
                [_size(p) for p in group["params"]], self._info.world_size, self._loads)
            self._owners.append(owners)
            out.append([(j, Piece(p, p, 0)) for j, (p, owner) in enumerate(zip(group["params"],
                                                                                owners))
                        if owner == self._info.rank])
        return out

    def _bucket_pieces(self, groups: list[dict[str, Any]]) -> list[list[tuple[int, Piece]]]:
        by_param = self._buckets.pieces  # type: ignore[union-attr]
        return [[(j, by_param[id(p)]) for j, p in enumerate(g["params"]) if id(p) in by_param]
                for g in groups]

    def _finish_buckets(self) -> None:
        """Wait for this step's reductions; if the buckets were rebuilt along the learned
        gradient order (once, in the first step), move the local optimizer onto the new
        pieces, with any state it holds (a checkpoint loaded before the first step)."""
        buckets = self._buckets
        version = buckets.layout_version  # type: ignore[union-attr]
        buckets.finish()  # type: ignore[union-attr]
        if buckets.layout_version != version and self._whole is None:  # type: ignore[union-attr]
            self._adopt_pieces()  # (whole parameters keep their owners: nothing moves)

    @property
    def gradient_order(self) -> list[int] | None:
        """The order the reduce-scatter path's buckets follow, learned in the first step
        (None before, and on the broadcast path): a checkpoint keeps it, so that a resumed
        run cuts its buckets, and sums, as the interrupted one did."""
        return None if self._buckets is None else self._buckets.learned_order

    def set_gradient_order(self, order: list[int] | None) -> None:
        """Follow a checkpoint's :attr:`gradient_order` from the first step (the buckets
        are rebuilt now, the local optimizer moved onto the new pieces with its state).
        Collective; ignored on the broadcast path and for None."""
        if self._buckets is None or order is None:
            return
        version = self._buckets.layout_version
        self._buckets.follow_order(order)
        if self._buckets.layout_version != version and self._whole is None:
            self._adopt_pieces()

    def _adopt_pieces(self) -> None:
        """The buckets were rebuilt: move the local optimizer onto the new pieces, with
        the state it holds (collective)."""
        shards: list[Any] = [None] * self._info.world_size
        dist.all_gather_object(shards, state_of_pieces(self._local.state,
                                                       self._numbered_pieces()),
                               group=self._info.group)
        self._pieces = self._bucket_pieces(self.param_groups)
        for local, pieces in zip(self._local.param_groups, self._pieces):
            local["params"] = [piece.local for _, piece in pieces]
        self._local.state.clear()
        if any(shards):
            params = [p for g in self.param_groups for p in g["params"]]
            full = {"state": merge_pieces(shards, [p.shape for p in params]),
                    "param_groups": pack_param_groups(self.param_groups)}
            self._local.load_state_dict(select_pieces(full, self._pieces))
            self.state = self._local.state  # type: ignore[assignment]

    def _rebuild_exchange(self) -> None:
        if self._info.world_size == 1 or self._buckets is not None:
            return
        by_rank: list[list[torch.Tensor]] = [[] for _ in range(self._info.world_size)]
        for group, owners in zip(self.param_groups, self._owners):
            for p, owner in zip(group["params"], owners):
                by_rank[owner].append(p)
        self._exchange = ParameterExchange(by_rank, self._info.group, self._info.global_ranks)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group and shard its parameters (collective: call it on every rank).

        Also works mid-training (unfreezing layers): on the broadcast path the new
        parameters continue the load balance and the parameter buffers are rebuilt; on
        the reduce-scatter path they get buckets of their own.

        Args:
            param_group: a dict with ``params`` and optional hyperparameters.
        """
        if getattr(self, "_constructing", False):
            # Optimizer.__init__ registering the groups we prepared.
            super().add_param_group(param_group)
            return
        group = normalize_new_group(param_group, self.param_groups)
        check_same_on_every_rank(self._info, [group["params"]], "add_param_group")
        loads_before, owners_before = list(self._loads), len(self._owners)
        pieces = self._shard([group])[0]
        mine = [piece.local for _, piece in pieces]
        try:
            self._local.add_param_group({**hyperparameters(group), "params": mine})
        except BaseException:
            self._loads = loads_before  # the broadcast path's partition, as it was
            del self._owners[owners_before:]
            raise
        self._pieces.append(pieces)
        local = self._local.param_groups[-1]
        super().add_param_group({**hyperparameters(local), "params": group["params"]})
        self._consolidated_state = None
        self._rebuild_exchange()

    # ------------------------------------------------------------------ gradients
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, sending nothing; the next
        one outside sends the sum. (Reduce-scatter path; elsewhere a no-op: the DDP
        wrapper's own ``no_sync`` does this on the broadcast path.)"""
        if self._buckets is None:
            yield
            return
        with self._buckets.no_sync():
            yield

    def finish_gradient_synchronization(self) -> None:
        """Wait for this step's gradient reductions (collective; ``step`` and
        :meth:`clip_grad_norm_` call it, and later calls do nothing until the step)."""
        if self._buckets is not None:
            self._finish_buckets()

    def shard_gradients(self) -> list[torch.Tensor]:
        """The averaged gradients this rank steps: the pieces' ``.grad`` on the
        reduce-scatter path (after :meth:`finish_gradient_synchronization`), else every
        parameter's ``.grad``."""
        if self._buckets is not None:
            self._finish_buckets()
            return self._buckets.shard_gradients()
        return [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the averaged gradients so that their global norm is at most ``max_norm``,
        as ``torch.nn.utils.clip_grad_norm_`` over all parameters would; returns the
        norm before clipping. Collective: on the reduce-scatter path each rank's shard
        norms are combined by one all-reduce of a scalar.

        Raises:
            ValueError: a negative or NaN ``max_norm``, or a ``norm_type`` below 1.
        """
        max_norm, norm_type = float(max_norm), float(norm_type)
        if not max_norm >= 0:
            raise ValueError(f"ShardedOptimizer.clip_grad_norm_: max_norm must be >= 0, "
                             f"got {max_norm}")
        if not norm_type >= 1:
            raise ValueError(f"ShardedOptimizer.clip_grad_norm_: norm_type must be >= 1 "
                             f"(or inf), got {norm_type}")
        if self._buckets is None:
            params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        grads = self.shard_gradients()
        if not grads:  # no trainable parameter on any rank (they agree): as torch's own
            return torch.zeros(())
        wide = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
        norms = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=wide) for g in grads])
        if norm_type == float("inf"):
            total = norms.max()
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self._info.group)
        else:
            total = norms.pow(norm_type).sum()
            dist.all_reduce(total, group=self._info.group)
            total = total.pow(1.0 / norm_type)
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef)
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every parameter's gradient and this rank's gradient shards."""
        super().zero_grad(set_to_none=set_to_none)
        if self._buckets is not None:
            self._buckets.zero_grad()

    # ------------------------------------------------------------------ stepping
    def _push_hyperparameters(self) -> None:
        """Copy hyperparameters from our groups (where schedulers edit them) to the shard."""
        for group, local in zip(self.param_groups, self._local.param_groups):
            local.update({k: v for k, v in group.items() if k not in PARAM_KEYS})

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:  # type: ignore[override]
        """Step this rank's shard, then give every rank the updated parameters.

        Collective. ``closure`` (if any) is evaluated once, here, on every rank.

        Args:
            closure: re-evaluates the model and returns the loss.
            **kwargs: passed on to the local optimizer's ``step``.

        Returns:
            The closure's loss, or None.

        Raises:
            Whatever the local optimizer's step raised, after this rank has taken its part
            in the parameter exchange (with its shard as it was): the other ranks finish
            the step instead of waiting for it until the process group's timeout.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        buckets = self._buckets
        if buckets is not None:
            self._finish_buckets()
            buckets.ensure_bound()
        elif self._exchange is not None:
            self._exchange.ensure_bound()
        self._push_hyperparameters()
        failure = None
        if self._whole is not None:
            failure = self._step_whole(**kwargs)
        else:
            try:
                self._local.step(**kwargs)
            except Exception as exc:  # re-raised below
                # The other ranks are about to wait for this rank's shard: send it (as it
                # was) before raising, so that no rank is left waiting in the exchange.
                failure = exc
        if buckets is not None:
            buckets.gather_parameters()
            buckets.end_step()
        elif self._exchange is not None:
            self._exchange.synchronize()
        self._consolidated_state = None
        if failure is not None:
            raise failure
        return loss

    def _step_whole(self, **kwargs: Any) -> BaseException | None:
        """Each owner steps its whole parameters over the averaged gradient shards
        (:mod:`zero1.whole_params`); every rank's shard takes the new values."""
        buckets, whole = self._buckets, self._whole
        assert buckets is not None and whole is not None
        if not whole.has_spans or self._spans_version != buckets.layout_version:
            whole.set_spans(buckets.spans())
            self._spans_version = buckets.layout_version
        held = {key: (piece.local, piece.local.grad) for key, piece in buckets.pieces.items()}
        unused = {id(buckets.params[i]) for i in buckets.unused}
        return whole.step(self._local, held, unused, **kwargs)

    # ------------------------------------------------------------------ checkpoints
    def _numbered_pieces(self) -> list[tuple[int, Piece]]:
        """(global parameter number, piece) of every piece this rank holds."""
        out, start = [], 0
        for group, pieces in zip(self.param_groups, self._pieces):
            out.extend((start + j, piece) for j, piece in pieces)
            start += len(group["params"])
        return out

    def numbered_pieces(self) -> list[tuple[int, Piece]]:
        """(global parameter number, piece) of every piece this rank steps: the local
        optimizer keys its state by ``piece.local``, the range of the flattened
        ``piece.param`` that starts at ``piece.start`` (what a checkpoint that never
        gathers writes and reads)."""
        return self._numbered_pieces()

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's shard state onto rank ``to`` (collective; tensors on CPU).

        Afterwards ``state_dict()`` on rank ``to`` returns the full state, until the
        next ``step``, ``add_param_group`` or ``load_state_dict``.

        Args:
            to: the rank in the sharding group that receives the state.
        """
        info = self._info
        self._consolidated_state = gather_full_state(
            self._local.state, self._numbered_pieces(), self.param_groups, to,
            rank=info.rank, world_size=info.world_size, group=info.group,
            global_rank=info.global_ranks.__getitem__, who="ShardedOptimizer")

    def state_dict(self) -> dict[str, Any]:
        """The full state in ``optimizer_cls``'s format (only after consolidation).

        Raises:
            RuntimeError: on ranks other than the one consolidated to, or when the state
                changed since ``consolidate_state_dict``.
        """
        if self._consolidated_state is None:
            raise RuntimeError(
                f"ShardedOptimizer.state_dict: rank {self._info.rank} holds no consolidated "
                "state. Call consolidate_state_dict(to=r) on every rank (again after any "
                "step), then state_dict() on rank r only."
            )
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        state_dict: dict[str, Any] = {
            "state": dict(self._consolidated_state),
            "param_groups": pack_param_groups(self.param_groups),
        }
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state dict (ours or a plain ``optimizer_cls``'s), at any world size.

        Every rank keeps the state of what it steps and takes the groups'
        hyperparameters. Not a collective, but call it on every rank.

        Everything is checked before anything changes (see :mod:`zero1.checkpoint`): a
        state dict of the wrong type, layout or optimizer raises, and the optimizer is
        left as it was.

        Args:
            state_dict: what ``state_dict()`` returned, possibly saved by another world
                size, or a plain optimizer's state dict over the same parameters.

        Raises:
            TypeError: not a state dict (a list, ...), or parts of it of the wrong type.
            ValueError: another number of groups or parameters, another optimizer's
                state (SGD's into AdamW), or a state tensor of the wrong shape.
        """
        if not isinstance(state_dict, Mapping):
            check_state_dict(state_dict, self.param_groups, self.defaults)  # raises TypeError
        state_dict = dict(state_dict)
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        load_full_state(state_dict, self.param_groups, self.defaults, self._local,
                        self._pieces, who="ShardedOptimizer")
        self.state = self._local.state  # type: ignore[assignment]
        self._consolidated_state = None
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def __repr__(self) -> str:
        path = ("broadcast" if self._buckets is None else
                "reduce-scatter, whole parameters on owners" if self._whole is not None else
                "reduce-scatter")
        return (
            f"ShardedOptimizer({self._optimizer_cls.__name__}, stage {self.stage}, {path}, rank "
            f"{self._info.rank} of {self._info.world_size}, {len(self.param_groups)} param groups)"
        )
