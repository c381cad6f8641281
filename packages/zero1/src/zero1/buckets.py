"""ZeRO at data parallelism's volume: gradients reduce-scattered in flat buckets during
backward, each rank stepping its equal shard, the updated parameters all-gathered.

Layout. The trainable parameters are cut into buckets along reverse order (backward
roughly reverses forward; :func:`minddp.assign_buckets`, the same rule as minddp's
``DDPBucketed``). Each bucket is one flat buffer of parameters, padded to a multiple
of the world size N and cut into N equal shards: rank r owns elements
``[r*C, (r+1)*C)`` of every bucket, ``C = padded / N``. A parameter may straddle two
or more shards; each rank steps the *pieces* of parameters that fall in its shard
(1-D views of the flat buffer), which is exact for every optimizer whose update is
elementwise (AdamW, Adam, SGD, RMSprop, Adagrad, ...). Equal shards are what a
reduce-scatter needs: the greedy whole-parameter partition of the broadcast path
(:mod:`zero1.exchange`) would need padding to the largest rank's share in every
collective.

One step, on every rank:

1. Backward: when the last member of a bucket has its gradient (a post-accumulate-
   grad hook per parameter), the bucket's gradients are packed into a flat buffer and
   an asynchronous reduce-scatter starts, leaving this rank the average over ranks of
   its shard. Bucket i never starts before bucket i-1, so every rank issues the same
   collectives in the same order. At the end of each backward (an autograd-engine
   callback) the buckets still waiting, those with a member that got no gradient,
   start with zeros for the missing ones.
2. ``finish``: wait for the reduce-scatters, learn which parameters no rank used (one
   small all-reduce of a flag per parameter), and point each piece's ``.grad`` at its
   averaged gradient (None for parameters no rank used, as one process would leave
   them, so the optimizer skips them).
3. The local optimizer steps the pieces in place; then every bucket's parameter buffer
   is all-gathered in place from its shards.

That is Ψ sent by the reduce-scatters and Ψ by the all-gathers (Ψ parameter elements),
2Ψ in all, as much as an all-reduce of the gradients alone.

Stages. Stage 1 keeps a persistent full-size gradient buffer per bucket, and each
parameter's ``.grad`` is a view into it holding this rank's local (not averaged)
gradient, as autograd accumulated it; the shard's average lives in a separate buffer
of 1/N of the size. Stage 2 keeps only that 1/N: each bucket's gradients are packed
into one reusable send buffer (one per dtype and device, the size of the largest
bucket) and the parameters' ``.grad`` are set to None as soon as they are packed, so
full-size gradients exist only while autograd produces them and one bucket at a time
in the send buffer. Gradient accumulation: stage 1 accumulates in ``.grad`` (use
``no_sync`` for all micro-steps but the last, or each micro-step sends again); stage 2
reduce-scatters every synchronized backward and adds the result into the shard, so it
accumulates with no full-size gradient at all (or with ``no_sync`` like stage 1).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from minddp import TensorInfo, adopt_gradients, assign_buckets, copy_all, zero_all

if TYPE_CHECKING:
    from .sharded_optimizer import GroupInfo

#: How a bucket is reduce-scattered and all-gathered. "tensor": one
#: ``reduce_scatter_tensor`` and one ``all_gather_into_tensor`` per bucket (NCCL's fast
#: path). "rooted": one ``reduce`` to each owner and one ``broadcast`` from each owner, the
#: same bytes; on Gloo these are 2-4x faster than its reduce-scatter and all-gather (25 MiB
#: on 2 CPU ranks: 112 ms against 232 ms to reduce, 54 against 219 ms to gather).
#: "auto": rooted on Gloo, tensor elsewhere.
COLLECTIVES = ("auto", "tensor", "rooted")


@dataclass
class Piece:
    """The part of one parameter a rank steps.

    Attributes:
        param: the model's parameter.
        local: what the local optimizer holds: the parameter itself (broadcast path,
            one rank) or a 1-D view of the flat buffer (bucket path).
        start: offset of ``local``'s first element in the flattened parameter.
    """

    param: torch.Tensor
    local: torch.Tensor
    start: int


@dataclass
class _Bucket:
    members: list[int]  # indices into ShardedBuckets.params, in buffer order
    offsets: list[int]  # each member's first element in the flat buffer
    numel: int  # real elements (the rest up to padded is padding)
    padded: int
    shard: int  # C: elements per rank
    params: torch.Tensor  # flat parameter buffer, padded
    grad_shard: torch.Tensor  # this rank's averaged gradient, C elements
    grads: torch.Tensor | None = None  # stage 1: full local gradients, padded
    views: list[torch.Tensor] = field(default_factory=list)  # stage 1: members' .grad
    wire: torch.Tensor | None = None  # stage 1 with reduce_dtype: send buffer
    pointers: list[int] = field(default_factory=list)  # each member's bound data_ptr
    fresh: bool = True  # stage 2: the next reduction replaces the shard instead of adding
    sent: bool = False  # stage 1: reduced once already this step


@dataclass
class _Reduction:
    """One reduce-scatter in flight and where its result goes."""

    works: list[dist.Work]
    bucket: _Bucket
    output: torch.Tensor  # where this rank's sum lands: grad_shard, or a temporary
    accumulate: bool = False  # add the result into grad_shard (else replace it)
    done: bool = False


class ShardedBuckets:
    """Buckets, hooks and collectives of the reduce-scatter path of one optimizer.

    Args:
        info: the process group (more than one rank).
        stage: 1 or 2 (see the module docstring).
        bucket_size_mb, bucket_rule: how buckets are cut (minddp's rules).
        reduce_dtype: the dtype gradients travel and are averaged in; None: their own.
    """

    def __init__(self, info: GroupInfo, stage: int, bucket_size_mb: float | None,
                 bucket_rule: str, reduce_dtype: torch.dtype | None,
                 collectives: str = "auto") -> None:
        self.info = info
        self.stage = stage
        self.bucket_size_mb = bucket_size_mb
        self.bucket_rule = bucket_rule
        self.reduce_dtype = reduce_dtype
        self.params: list[torch.Tensor] = []
        self.buckets: list[_Bucket] = []
        self._bucket_of: list[int] = []
        self._pieces: dict[int, Piece] = {}  # id(param) -> this rank's piece
        self._piece_grads: list[tuple[Piece, torch.Tensor, int]] = []  # (piece, view, index)
        self._pools: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._pool_pending: dict[tuple[torch.dtype, torch.device], _Reduction] = {}
        group = info.group if info.group is not None else dist.group.WORLD
        self._group = group
        self._native_average = (getattr(dist.ReduceOp, "AVG", None) is not None
                                and dist.get_backend(info.group) == "nccl")
        self._op = dist.ReduceOp.AVG if self._native_average else dist.ReduceOp.SUM
        if collectives not in COLLECTIVES:
            raise ValueError(f"collectives must be one of {', '.join(COLLECTIVES)}, got "
                             f"{collectives!r}")
        if collectives == "auto":
            collectives = "rooted" if dist.get_backend(info.group) == "gloo" else "tensor"
        self.collectives = collectives
        self._rooted = collectives == "rooted"
        self._hooks: list = []
        self.sync_enabled = True
        self._reset_step()

    # ------------------------------------------------------------------ layout
    @torch.no_grad()
    def add(self, params: list[torch.Tensor]) -> list[Piece]:
        """Bucket ``params`` (trainable, new), bind them to flat buffers, hook them, and
        broadcast rank 0's values into them; return this rank's pieces (in the order of
        ``params``, only those with elements here). Collective."""
        first = len(self.params)
        self.params.extend(params)
        infos = [TensorInfo(p.numel(), p.element_size(), (p.dtype, p.device)) for p in params]
        plan = assign_buckets(infos, self.bucket_size_mb, rule=self.bucket_rule)
        self._bucket_of.extend([0] * len(params))
        rank, world = self.info.rank, self.info.world_size
        for members in plan:
            members = [first + i for i in members]
            bucket = self._make_bucket(members, world)
            b = len(self.buckets)
            self.buckets.append(bucket)
            mine = range(rank * bucket.shard, (rank + 1) * bucket.shard)
            for index, offset in zip(members, bucket.offsets):
                self._bucket_of[index] = b
                p = self.params[index]
                lo, hi = max(offset, mine.start), min(offset + p.numel(), mine.stop)
                if lo < hi:
                    piece = Piece(p, bucket.params[lo:hi], lo - offset)
                    self._pieces[id(p)] = piece
                    view = bucket.grad_shard[lo - mine.start : hi - mine.start]
                    self._piece_grads.append((piece, view, index))
            dist.broadcast(bucket.params, src=self.info.global_ranks[0], group=self.info.group)
        self._register_hooks(first)
        self._reset_step()
        return [self._pieces[id(p)] for p in params if id(p) in self._pieces]

    def _make_bucket(self, members: list[int], world: int) -> _Bucket:
        params = [self.params[i] for i in members]
        numel = sum(p.numel() for p in params)
        padded = max(world, math.ceil(numel / world) * world)
        first = params[0]
        flat = torch.zeros(padded, dtype=first.dtype, device=first.device)
        offsets, offset = [], 0
        for p in params:
            offsets.append(offset)
            view = flat[offset : offset + p.numel()].view(p.shape)
            view.copy_(p.data)
            p.data = view  # the old storage goes as soon as nothing else holds it
            offset += p.numel()
        bucket = _Bucket(members, offsets, numel, padded, padded // world, flat,
                         torch.zeros(padded // world, dtype=first.dtype, device=first.device))
        bucket.pointers = [p.data_ptr() for p in params]
        wire = self._wire_dtype(first.dtype)
        if self.stage == 2 or self._rooted:
            key = (wire, first.device)
            pool = self._pools.get(key)
            if pool is None or pool.numel() < padded:
                self._pools[key] = torch.empty(padded, dtype=key[0], device=first.device)
        if self.stage == 1:
            bucket.grads = torch.zeros(padded, dtype=first.dtype, device=first.device)
            bucket.views = [bucket.grads[o : o + p.numel()].view(p.shape)
                            for o, p in zip(offsets, params)]
            for p, view in zip(params, bucket.views):
                if p.grad is not None:  # keep a gradient the user already has
                    view.copy_(p.grad)
                    p.grad = view
            if wire != first.dtype and not self._rooted:
                bucket.wire = torch.empty(padded, dtype=wire, device=first.device)
        return bucket

    def _wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.reduce_dtype if self.reduce_dtype is not None else dtype

    def ensure_bound(self) -> None:
        """Rebind parameters that something else rebound (``p.data = ...``) since, keeping
        their current values: the pieces and the optimizer state stay valid."""
        for bucket in self.buckets:
            params = [self.params[i] for i in bucket.members]
            if list(map(torch.Tensor.data_ptr, params)) == bucket.pointers:
                continue
            with torch.no_grad():
                for p, offset in zip(params, bucket.offsets):
                    if p.dtype != bucket.params.dtype or p.device != bucket.params.device:
                        raise RuntimeError(
                            f"ShardedOptimizer: a parameter moved to {p.dtype} on {p.device} "
                            "after the optimizer was built; build the optimizer after moving "
                            "the model")
                    view = bucket.params[offset : offset + p.numel()].view(p.shape)
                    if p.data_ptr() != view.data_ptr():
                        view.copy_(p.data)
                        p.data = view
            bucket.pointers = [p.data_ptr() for p in params]

    # ------------------------------------------------------------------ hooks
    def _register_hooks(self, first: int) -> None:
        this = weakref.ref(self)
        for index in range(first, len(self.params)):

            def hook(_param: torch.Tensor, index: int = index) -> None:
                buckets = this()
                if buckets is not None:
                    buckets._on_grad(index)

            self._hooks.append(self.params[index].register_post_accumulate_grad_hook(hook))

    def _reset_step(self) -> None:
        self._used = [False] * len(self.params)  # got a gradient in any backward this step
        self._rounds = 0  # synchronized backwards this step
        self._in_round = False
        self._finished = False
        self._pending: list[_Reduction] = []  # reductions in flight

    def _start_round(self) -> None:
        self._in_round = True
        self._ready = [False] * len(self.params)
        self._remaining = [len(b.members) for b in self.buckets]
        self._next = 0
        # Runs once the whole backward is done, on the engine's thread.
        torch.autograd.Variable._execution_engine.queue_callback(self._end_round)

    def _on_grad(self, index: int) -> None:
        """Parameter ``index``'s ``.grad`` was just updated by autograd."""
        self._used[index] = True
        if not self.sync_enabled:
            return
        if not self._in_round:
            self._start_round()
            self._finished = False
        b = self._bucket_of[index]
        if self._ready[index]:
            if b < self._next:
                raise RuntimeError(
                    "ShardedOptimizer: a parameter received a second gradient in one backward "
                    "after its bucket had been sent (a parameter reached twice, e.g. through "
                    "reentrant checkpointing)")
            return
        self._ready[index] = True
        self._remaining[b] -= 1
        if self._remaining[b] == 0 and b == self._next:
            with torch.no_grad():
                n = b
                while n < len(self.buckets) and self._remaining[n] == 0:
                    self._launch(self.buckets[n])
                    n += 1
            self._next = n

    def _end_round(self) -> None:
        """End of a synchronized backward: send the buckets still waiting, in order."""
        with torch.no_grad():
            for b in range(self._next, len(self.buckets)):
                self._launch(self.buckets[b])
            if self.stage == 1:
                # A later backward of this step accumulates into the buffers being sent:
                # they must have been read first.
                self._complete_pending()
        self._next = len(self.buckets)
        self._in_round = False
        self._rounds += 1

    # ------------------------------------------------------------------ collectives
    def _launch(self, bucket: _Bucket) -> None:
        """Start bucket ``bucket``'s reduction (its members' gradients are complete)."""
        params = [self.params[i] for i in bucket.members]
        key = (self._wire_dtype(bucket.params.dtype), bucket.params.device)
        if self.stage == 1:
            # Every member's .grad becomes its view of the bucket, keeping its value.
            adopt_gradients(params, bucket.views)
            if not self._rooted:
                send = bucket.grads
                if bucket.wire is not None:
                    bucket.wire.copy_(bucket.grads)
                    send = bucket.wire
                # The first reduction of a step may land in the shard itself; a later
                # one (accumulation without no_sync) replaces it once both are done.
                self._start(bucket, send, direct=not bucket.sent)
                bucket.sent = True
                return
            # Rooted reductions use their input as scratch: send a copy.
            send = self._free_pool(key)[: bucket.padded]
            send.copy_(bucket.grads)
            self._pool_pending[key] = self._start(bucket, send, direct=False)
            return
        send = self._free_pool(key)[: bucket.padded]
        grads, targets, missing = [], [], []
        for p, offset in zip(params, bucket.offsets):
            view = send[offset : offset + p.numel()].view(p.shape)
            if p.grad is None:
                missing.append(view)
            else:
                grads.append(p.grad)
                targets.append(view)
                p.grad = None  # the full-size gradient is not kept (stage 2)
        if targets:
            copy_all(targets, grads)
        if bucket.padded > bucket.numel:
            missing.append(send[bucket.numel :])
        if missing:
            zero_all(missing)
        self._pool_pending[key] = self._start(bucket, send, direct=bucket.fresh,
                                              accumulate=not bucket.fresh)
        bucket.fresh = False

    def _free_pool(self, key: tuple[torch.dtype, torch.device]) -> torch.Tensor:
        """The send buffer of ``key``, once the reduction that last used it is done."""
        previous = self._pool_pending.pop(key, None)
        if previous is not None:
            self._complete(previous)
        return self._pools[key]

    def _start(self, bucket: _Bucket, send: torch.Tensor, *, direct: bool,
               accumulate: bool = False) -> _Reduction:
        """Reduce ``send`` (the bucket's gradients, padded) so that this rank gets the
        sum of its shard; ``direct``: into the bucket's shard itself, where the dtype
        allows (else into a temporary, copied or, with ``accumulate``, added after)."""
        info = self.info
        c = bucket.shard
        if self._rooted:
            # One reduce to each owner: on Gloo much faster than its reduce-scatter.
            works = [dist.reduce(send[r * c : (r + 1) * c], dst=info.global_ranks[r],
                                 op=dist.ReduceOp.SUM, group=info.group, async_op=True)
                     for r in range(info.world_size)]
            output = send[info.rank * c : (info.rank + 1) * c]
        else:
            output = (bucket.grad_shard if direct and send.dtype == bucket.grad_shard.dtype
                      else torch.empty(c, dtype=send.dtype, device=send.device))
            works = [dist.reduce_scatter_tensor(output, send, op=self._op, group=info.group,
                                                async_op=True)]
        entry = _Reduction(works, bucket, output, accumulate)
        self._pending.append(entry)
        return entry

    def _complete(self, r: _Reduction) -> None:
        """Wait for one reduction and leave its average in the bucket's shard."""
        if r.done:
            return
        for work in r.works:
            work.wait()
        r.done = True
        if self._rooted or not self._native_average:
            r.output.div_(self.info.world_size)
        if r.output is not r.bucket.grad_shard:
            if r.accumulate:
                r.bucket.grad_shard.add_(r.output)
            else:
                r.bucket.grad_shard.copy_(r.output)

    # ------------------------------------------------------------------ per step
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous = self.sync_enabled
        self.sync_enabled = False
        try:
            yield
        finally:
            self.sync_enabled = previous

    def _complete_pending(self) -> None:
        for entry in self._pending:
            self._complete(entry)
        self._pending = []
        self._pool_pending.clear()

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for this step's reductions and give each piece its averaged gradient, or
        None where no rank produced one (collective; idempotent until the next step).

        A rank whose backward reached no parameter (or that ran none) sends zeros, so
        that every rank issues the same collectives."""
        if self._in_round:
            raise RuntimeError("ShardedOptimizer: the gradients were asked for during backward")
        if self._finished:
            return
        if self._rounds == 0:
            self._next = 0
            self._end_round()
        used = torch.tensor(self._used, dtype=torch.float32, device=self.buckets[0].params.device)
        flags = dist.all_reduce(used, group=self.info.group, async_op=True)
        self._complete_pending()
        flags.wait()
        nobody: set[int] = set()
        if not all(self._used):  # only a parameter unused here can be unused everywhere
            nobody = {i for i, count in enumerate(used.tolist()) if count == 0}
        for piece, view, index in self._piece_grads:
            piece.local.grad = None if index in nobody else view
        for bucket in self.buckets:
            bucket.sent = False
        self._finished = True

    def end_step(self) -> None:
        """The step is done: the next ``finish`` waits for the next step's reductions."""
        self._rounds = 0
        self._used = [False] * len(self.params)
        self._finished = False

    def zero_grad(self) -> None:
        """The shards hold nothing from now on (the next reduction replaces them)."""
        for bucket in self.buckets:
            bucket.fresh = True
        for piece, _, _ in self._piece_grads:
            piece.local.grad = None

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """All-gather every bucket's parameters from the owners' updated shards."""
        info = self.info
        works = []
        for b in self.buckets:
            c = b.shard
            if self._rooted:  # one broadcast from each owner (see ``collectives``)
                works += [dist.broadcast(b.params[r * c : (r + 1) * c], src=info.global_ranks[r],
                                         group=info.group, async_op=True)
                          for r in range(info.world_size)]
            else:
                works.append(dist.all_gather_into_tensor(
                    b.params, b.params[info.rank * c : (info.rank + 1) * c], group=info.group,
                    async_op=True))
        for work in works:
            work.wait()

    def shard_gradients(self) -> list[torch.Tensor]:
        """This rank's averaged gradient buffers (padding is zero)."""
        return [b.grad_shard for b in self.buckets]

    def buffers(self) -> list[torch.Tensor]:
        """Every gradient buffer the path holds (for byte counts)."""
        out = [b.grad_shard for b in self.buckets]
        out += [b.grads for b in self.buckets if b.grads is not None]
        out += [b.wire for b in self.buckets if b.wire is not None]
        out += list(self._pools.values())
        return out
