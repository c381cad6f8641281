"""Whole parameters over flat shards: for optimizers whose update needs the whole tensor
(Muon's orthogonalisation, Adafactor's factored statistics).

Every ZeRO stage here keeps the averaged gradients, and stage 3 the parameters too, in
flat buffers cut into equal shards (:mod:`zero1.flat`): a matrix may lie in several
ranks' shards. An elementwise optimizer steps each piece where it lies; Muon cannot. So
each whole parameter gets an **owner** (largest first onto the least-loaded rank, by
elements: :func:`zero1.exchange.partition_parameters`, a pure function of the shapes),
which alone holds its optimizer state (whole, in the plain optimizer's format). A step:

1. :meth:`OwnerExchange.to_owners`: every rank sends the pieces it holds of each
   parameter (the averaged gradient, and in stage 3 the values) to its owner, one
   ``all_to_all_single`` per dtype;
2. each owner's local optimizer steps its whole parameters;
3. :meth:`OwnerExchange.from_owners`: each owner sends every holder the new values of
   its piece, one ``all_to_all_single`` per dtype; then the stage's own exchange runs
   (stages 1 and 2: the buckets' all-gather; stage 3: the next forward's gathers).

Sent per step, over all ranks: each direction moves every element of every whole
parameter that lies outside its owner's shard, about Ψ_W(N-1)/N for Ψ_W elements of
whole parameters on N ranks, so Ψ_W(N-1)/N² per rank: (N-1)/N of a matrix lies in other
ranks' shards, and 1/N of the matrices are a rank's. Stages 1 and 2 send the gradients
in and the values out (2Ψ_W(N-1)/N² per rank, on top of the buckets' 2Ψ); stage 3 the
gradients and the values in, the values out (3Ψ_W(N-1)/N², on top of its 3Ψ).

Why not reduce each matrix's gradient to its owner instead (Ψ_W, the same volume as the
reduce-scatter it replaces): the matrices would then leave the buckets, which are what
overlap the reduction with backward, follow the learned gradient order, free the
gradients in stage 2, accumulate with ``no_sync``, clip by the global norm and reduce in
``reduce_dtype``, and equal shards are what ``reduce_scatter_tensor`` needs. Here the
buckets stay as they are for every optimizer, and the extra traffic shrinks as 1/N.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from .exchange import partition_parameters
from .flat import Piece
from .muon import Muon
from .param_groups import PARAM_KEYS

#: Optimizers that step whole parameters: their update of an element needs the whole
#: tensor. (SparseAdam, whose gradients are sparse, and LBFGS, whose one state covers
#: every parameter, are stepped by neither path.)
WHOLE_PARAMETER_OPTIMIZERS: tuple[type[Optimizer], ...] = (Muon,) + tuple(
    getattr(torch.optim, name) for name in ("Muon", "Adafactor") if hasattr(torch.optim, name))


def steps_whole_parameters(optimizer_cls: type) -> bool:
    """Whether ``optimizer_cls`` must step whole parameters (Muon, Adafactor): the sharded
    optimizers then step each parameter on its owner (this module)."""
    return isinstance(optimizer_cls, type) and issubclass(optimizer_cls,
                                                          WHOLE_PARAMETER_OPTIMIZERS)


def check_whole_parameter_groups(optimizer_cls: type[Optimizer],
                                 groups: Sequence[Mapping[str, Any]],
                                 defaults: Mapping[str, Any]) -> None:
    """Build ``optimizer_cls`` over ``meta`` copies of every parameter, so that what it
    refuses (Muon: a parameter that is not 2-D; a bad hyperparameter) raises on every rank
    before any collective, not only on the rank that owns the parameter."""
    trial = [{**{k: v for k, v in g.items() if k not in PARAM_KEYS},
              "params": [torch.empty_like(p, device="meta") for p in g["params"]]}
             for g in groups]
    optimizer_cls(trial, **defaults)


class OwnerExchange:
    """Moves pieces of whole parameters between the ranks that hold them and the owners.

    Parameters are numbered 0, 1, ... in one order every rank agrees on.

    Args:
        spans: per parameter, ``(rank, start, numel)`` for every rank holding elements
            ``[start, start + numel)`` of it (flattened); at most one span per rank.
        owners: per parameter, the rank that steps it whole.
        dtypes: per parameter, the dtype its pieces travel in (one collective per dtype).
        device: where the pieces are.
        rank, world_size: this process in ``group``.
        group: the process group (None: the default one).
    """

    def __init__(self, spans: Sequence[Sequence[tuple[int, int, int]]],
                 owners: Sequence[int], dtypes: Sequence[torch.dtype], device: torch.device,
                 rank: int, world_size: int, group: dist.ProcessGroup | None) -> None:
        self.rank, self.world_size, self.group = rank, world_size, group
        self.device = device
        self.owners = list(owners)
        self._spans = [{r: (start, n) for r, start, n in held} for held in spans]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, dtype in enumerate(dtypes):
            by_dtype.setdefault(dtype, []).append(i)
        self._classes = list(by_dtype.values())  # parameters by dtype, first-seen order
        self._dtypes = list(by_dtype)
        #: Elements crossing ranks in each direction, over all ranks (per dtype class).
        self.crossing = [sum(n for i in members for r, (_, n) in self._spans[i].items()
                             if r != self.owners[i]) for members in self._classes]

    def _owned_by(self, members: Sequence[int], rank: int) -> list[int]:
        return [i for i in members if self.owners[i] == rank]

    @torch.no_grad()
    def to_owners(self, pieces: Mapping[int, Sequence[torch.Tensor]],
                  whole: Mapping[int, Sequence[torch.Tensor]]) -> None:
        """Fill each owned parameter's flat tensors from the ranks' pieces (collective).

        Args:
            pieces: for each parameter this rank holds a span of, its k 1-D tensors
                (e.g. the averaged gradient's piece, and the values' piece).
            whole: for each parameter this rank owns, k flat tensors of its full size.
        """
        self._move(pieces, whole, inbound=True)

    @torch.no_grad()
    def from_owners(self, whole: Mapping[int, Sequence[torch.Tensor]],
                    pieces: Mapping[int, Sequence[torch.Tensor]]) -> None:
        """Copy each owned parameter's flat tensors into the holders' pieces (collective).

        Args:
            whole: for each parameter this rank owns, k flat tensors of its full size.
            pieces: for each parameter this rank holds a span of, k 1-D tensors to fill.
        """
        self._move(pieces, whole, inbound=False)

    def _move(self, pieces: Mapping[int, Sequence[torch.Tensor]],
              whole: Mapping[int, Sequence[torch.Tensor]], *, inbound: bool) -> None:
        """One ``all_to_all_single`` per dtype class. The chunk between a holder and an
        owner holds, for each parameter of that owner's the holder has a span of, in
        order, the span's k tensors; the owner's own span is a local copy."""
        me = self.rank
        k = len(next(iter(pieces.values()), None) or next(iter(whole.values()), ()))
        for members, dtype, crossing in zip(self._classes, self._dtypes, self.crossing):
            for i in self._owned_by(members, me):  # the owner's own span: a local copy
                if me in self._spans[i]:
                    start, n = self._spans[i][me]
                    for piece, flat in zip(pieces[i], whole[i]):
                        if inbound:
                            flat[start:start + n].copy_(piece)
                        else:
                            piece.copy_(flat[start:start + n])
            if crossing == 0:  # every rank knows it: nothing crosses, no collective
                continue
            send: list[torch.Tensor] = []
            recv: list[torch.Tensor] = []
            send_sizes, recv_sizes = [0] * self.world_size, [0] * self.world_size
            for other in range(self.world_size):
                if other == me:
                    continue
                # What I hold of other's parameters goes out (inbound), or comes back.
                for i in self._owned_by(members, other):
                    if me in self._spans[i]:
                        n = self._spans[i][me][1]
                        (send if inbound else recv).extend(pieces[i][:k])
                        (send_sizes if inbound else recv_sizes)[other] += k * n
                # What other holds of my parameters comes in (inbound), or goes back.
                for i in self._owned_by(members, me):
                    if other in self._spans[i]:
                        start, n = self._spans[i][other]
                        (recv if inbound else send).extend(
                            flat[start:start + n] for flat in whole[i][:k])
                        (recv_sizes if inbound else send_sizes)[other] += k * n
            flat_send = (torch.cat([t.reshape(-1) for t in send]) if send
                         else torch.empty(0, dtype=dtype, device=self.device))
            flat_recv = torch.empty(sum(recv_sizes), dtype=dtype, device=self.device)
            dist.all_to_all_single(flat_recv, flat_send, recv_sizes, send_sizes,
                                   group=self.group)
            offset = 0
            for target in recv:
                target.copy_(flat_recv[offset:offset + target.numel()])
                offset += target.numel()


class WholeParameters:
    """The whole parameters of one sharded optimizer: their owners, the owners' local
    tensors (what the local optimizer steps) and the step through the owners.

    Args:
        rank, world_size, group: the process group the optimizer shards over.
        values_held: every rank holds every parameter's full values (stages 1 and 2: the
            owner steps a view of them); else (stage 3) the values are gathered from the
            shards into a buffer that exists only during the step.
    """

    def __init__(self, rank: int, world_size: int, group: dist.ProcessGroup | None, *,
                 values_held: bool) -> None:
        self.rank, self.world_size, self.group = rank, world_size, group
        self.values_held = values_held
        self.params: list[torch.Tensor] = []
        self.owners: list[int] = []
        self._loads = [0] * world_size
        self._locals: dict[int, torch.Tensor] = {}  # parameter number -> local tensor
        self._exchange: OwnerExchange | None = None

    def add(self, params: Sequence[torch.Tensor]) -> dict[int, Piece]:
        """Give ``params`` (trainable, new, in the agreed order) owners, continuing the
        balance; returns ``{id(param): piece}`` for those this rank owns, whose ``local``
        is what its local optimizer steps (a tensor of the parameter's shape)."""
        owners, self._loads = partition_parameters([p.numel() for p in params],
                                                   self.world_size, self._loads)
        first = len(self.params)
        self.params.extend(params)
        self.owners.extend(owners)
        self._exchange = None
        out = {}
        for k, (p, owner) in enumerate(zip(params, owners), start=first):
            if owner != self.rank:
                continue
            if self.values_held:
                local = p.detach()  # the same storage; re-pointed before each step
            else:
                local = torch.empty(p.shape, dtype=p.dtype, device=p.device)
                local.untyped_storage().resize_(0)  # allocated only during the step
            self._locals[k] = local
            out[id(p)] = Piece(param=p, local=local, start=0)
        return out

    def owner_of(self, param: torch.Tensor) -> int | None:
        for p, owner in zip(self.params, self.owners):
            if p is param:
                return owner
        return None

    def set_spans(self, spans: Mapping[int, Sequence[tuple[int, int, int]]]) -> None:
        """Where each parameter lies now: ``{id(param): [(rank, start, numel), ...]}``."""
        self._exchange = OwnerExchange([spans[id(p)] for p in self.params], self.owners,
                                       [p.dtype for p in self.params],
                                       self.params[0].device if self.params else
                                       torch.device("cpu"), self.rank, self.world_size,
                                       self.group)

    @property
    def has_spans(self) -> bool:
        return self._exchange is not None

    def step(self, optimizer: Optimizer,
             held: Mapping[int, tuple[torch.Tensor, torch.Tensor | None]],
             unused: set[int], **kwargs: Any) -> BaseException | None:
        """Gather, step on the owners, send the new values back (collective).

        Args:
            optimizer: the local optimizer over this rank's owned parameters' locals.
            held: ``{id(param): (values piece, averaged gradient piece or None)}`` of every
                span this rank holds (1-D views into its shards, written in place).
            unused: ``id`` of every parameter no rank gave a gradient (not stepped).
            **kwargs: passed to the optimizer's ``step``.

        Returns:
            What the local step raised (after this rank has sent its part, so that no
            rank waits for it), or None.
        """
        assert self._exchange is not None, "set_spans first"
        number = {id(p): k for k, p in enumerate(self.params)}
        pieces: dict[int, list[torch.Tensor]] = {}
        for key, (values, grad) in held.items():
            k = number[key]
            grad = grad if grad is not None else values.new_zeros(values.numel())
            pieces[k] = [grad] if self.values_held else [grad, values]
        whole: dict[int, list[torch.Tensor]] = {}
        grads: dict[int, torch.Tensor] = {}
        for k, local in self._locals.items():
            p = self.params[k]
            if self.values_held:
                local.data = p.detach()  # p may have been rebound since (new buckets)
            else:
                local.untyped_storage().resize_(p.numel() * p.element_size())
            grads[k] = local.new_empty(p.numel())
            whole[k] = [grads[k]] if self.values_held else [grads[k], local.view(-1)]
        self._exchange.to_owners(pieces, whole)
        for k, local in self._locals.items():
            local.grad = None if id(self.params[k]) in unused else grads[k].view(local.shape)
        failure = None
        try:
            optimizer.step(**kwargs)
        except Exception as exc:  # re-raised by the caller once every rank is through
            failure = exc
        self._exchange.from_owners({k: [local.view(-1)] for k, local in self._locals.items()},
                                   {number[key]: [values] for key, (values, _) in held.items()})
        for local in self._locals.values():
            local.grad = None
            if not self.values_held:
                local.untyped_storage().resize_(0)
        return failure
