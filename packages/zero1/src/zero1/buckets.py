"""Stages 1 and 2: gradients reduce-scattered in flat buckets during backward, each rank
stepping its equal shard, the updated parameters all-gathered after the step.

The trainable parameters are cut into buckets (minddp's bucket rules), and each bucket's
parameters live in one flat buffer sharded by :class:`zero1.flat.FlatLayout`. One step:

1. Backward. A hook per parameter counts gradients in; when a bucket is complete, and
   every bucket before it has gone, its gradients are packed flat and a reduce-scatter
   starts, leaving this rank the sum of its shard. At the end of backward the buckets
   still waiting (a member got no gradient) go, with zeros for the missing members.
2. ``finish``: wait, divide by N, learn which parameters no rank used (one all-reduce
   of a flag each), and point each piece's ``.grad`` at its averaged gradient.
3. The local optimizer steps the pieces; every bucket is all-gathered in place.

Ψ goes out in the reduce-scatters and Ψ in the all-gathers: 2Ψ, as an all-reduce does.

What the stages free. Stage 1 keeps each bucket's full-size local gradients (the
members' ``.grad`` are views of it) and the 1/N averaged shard. Stage 2 packs a bucket's
gradients into one send buffer (reused by every bucket) and drops the ``.grad``
tensors at once, so it keeps only the 1/N shard: ``_send_stage1`` and ``_send_stage2``
are the whole difference.

Bucket order. The first step's buckets follow reverse registration order. At the end
of the first synchronized step every rank takes the order in which rank 0's gradients
arrived, and the buckets are rebuilt once along it (as PyTorch's DDP does), so that a
bucket's members arrive together and at most one bucket of full-size gradients waits.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from minddp.buckets import TensorInfo, assign_buckets
from minddp.flat import adopt_gradients, copy_all, zero_all
from minddp.overlap import agree_on_order

from .flat import FlatLayout, Piece, ShardCollectives, bind, member_views
from .group import GroupInfo
from .rooted import RootedCollectives

#: How a bucket travels: "tensor" (``reduce_scatter_tensor`` and
#: ``all_gather_into_tensor``), "rooted" (:mod:`zero1.rooted`), "auto" (rooted on Gloo).
COLLECTIVES = ("auto", "tensor", "rooted")


@dataclass
class _Bucket:
    members: list[int]  # indices into ShardedBuckets.params, in buffer order
    layout: FlatLayout
    params: torch.Tensor  # flat parameter buffer, padded
    grad_shard: torch.Tensor  # this rank's averaged gradient
    grads: torch.Tensor | None = None  # stage 1: the members' local gradients, flat
    views: list[torch.Tensor] = field(default_factory=list)  # stage 1: members' .grad
    pointers: list[int] = field(default_factory=list)  # each member's bound data_ptr
    pieces: list[tuple[Piece, torch.Tensor, int]] = field(default_factory=list)  # this
    # rank's pieces: (piece, its averaged gradient in grad_shard, parameter index)
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
    """Buckets, hooks and collectives of stages 1 and 2 for one optimizer.

    Args:
        info: the process group (more than one rank).
        stage: 1 or 2 (see the module docstring).
        bucket_size_mb, bucket_rule: how buckets are cut (minddp's rules).
        reduce_dtype: the dtype gradients travel and are averaged in; None: their own.
        collectives: one of :data:`COLLECTIVES`.
    """

    def __init__(self, info: GroupInfo, stage: int, bucket_size_mb: float | None,
                 bucket_rule: str, reduce_dtype: torch.dtype | None,
                 collectives: str = "auto") -> None:
        if collectives not in COLLECTIVES:
            raise ValueError(f"collectives must be one of {', '.join(COLLECTIVES)}, got "
                             f"{collectives!r}")
        if collectives == "auto":
            collectives = "rooted" if dist.get_backend(info.group) == "gloo" else "tensor"
        self.collectives = collectives
        kind = RootedCollectives if collectives == "rooted" else ShardCollectives
        self.comm = kind(info.group, info.rank, info.global_ranks)
        self.info = info
        self.stage = stage
        self.bucket_size_mb = bucket_size_mb
        self.bucket_rule = bucket_rule
        self.reduce_dtype = reduce_dtype
        self.params: list[torch.Tensor] = []
        self.buckets: list[_Bucket] = []
        self.layout_version = 0  # changes when buckets are rebuilt (their pieces with them)
        self._observed: list[int] | None = []  # first-gradient order, until learned
        self._order: list[int] | None = None  # the learned order, once learned
        self._hooks: list = []
        self.sync_enabled = True
        self.unused: set[int] = set()  # parameters (numbers) no rank gave a gradient this step
        self._reset_step()

    # ------------------------------------------------------------------ layout
    @torch.no_grad()
    def add(self, params: list[torch.Tensor]) -> None:
        """Bucket ``params`` (trainable, new) in reverse order, bind them to flat buffers,
        hook them, and broadcast rank 0's values into them. Collective."""
        first = len(self.params)
        self.params.extend(params)
        plan = assign_buckets(self._infos(params), self.bucket_size_mb, rule=self.bucket_rule)
        new = [self._make_bucket([first + i for i in members]) for members in plan]
        for bucket in new:
            dist.broadcast(bucket.params, src=self.info.global_ranks[0], group=self.info.group)
        self._index(self.buckets + new)
        self._register_hooks(first)
        self._reset_step()

    def _infos(self, params: list[torch.Tensor]) -> list[TensorInfo]:
        return [TensorInfo(p.numel(), p.element_size(), (p.dtype, p.device)) for p in params]

    def _make_bucket(self, members: list[int]) -> _Bucket:
        params = [self.params[i] for i in members]
        layout = FlatLayout.of([p.numel() for p in params], self.info.world_size)
        first = params[0]
        flat = torch.zeros(layout.padded, dtype=first.dtype, device=first.device)
        bind(params, flat, layout)
        bucket = _Bucket(members, layout, flat, flat.new_zeros(layout.shard_numel),
                         pointers=[p.data_ptr() for p in params])
        start = layout.shard(self.info.rank).start
        for j, lo, hi in layout.pieces(self.info.rank):
            piece = Piece(params[j], flat[lo:hi], lo - layout.offsets[j])
            bucket.pieces.append((piece, bucket.grad_shard[lo - start : hi - start],
                                  members[j]))
        if self.stage == 1:
            bucket.grads = torch.zeros_like(flat)
            bucket.views = member_views(bucket.grads, [p.shape for p in params], layout)
            for p, view in zip(params, bucket.views):
                if p.grad is not None:  # keep a gradient the user already has
                    view.copy_(p.grad)
                    p.grad = view
        return bucket

    def _index(self, buckets: list[_Bucket]) -> None:
        """Adopt ``buckets`` (in launch order): which bucket each parameter is in, this
        rank's pieces, and the send buffers (one per dtype and device, the largest
        bucket's size)."""
        self.buckets = buckets
        self._plan = [b.members for b in buckets]
        self._bucket_of = [0] * len(self.params)
        self._piece_grads = [entry for b in buckets for entry in b.pieces]
        self.pieces = {id(piece.param): piece for piece, _, _ in self._piece_grads}
        sizes: dict[tuple[torch.dtype, torch.device], int] = {}
        for b, bucket in enumerate(buckets):
            for index in bucket.members:
                self._bucket_of[index] = b
            key = self._key(bucket)
            if self.stage == 2 or self.comm.scratches_input or key[0] != bucket.params.dtype:
                sizes[key] = max(sizes.get(key, 0), bucket.layout.padded)
        self._send = {key: torch.empty(n, dtype=key[0], device=key[1])
                      for key, n in sizes.items()}
        self._send_pending: dict[tuple[torch.dtype, torch.device], _Reduction] = {}

    def _key(self, bucket: _Bucket) -> tuple[torch.dtype, torch.device]:
        """The dtype gradients travel in, and the device."""
        return (self.reduce_dtype or bucket.params.dtype, bucket.params.device)

    def ensure_bound(self) -> None:
        """Rebind parameters that something else rebound (``p.data = ...``) since, keeping
        their current values: the pieces and the optimizer state stay valid."""
        for bucket in self.buckets:
            params = [self.params[i] for i in bucket.members]
            if list(map(torch.Tensor.data_ptr, params)) == bucket.pointers:
                continue
            for p in params:
                if p.dtype != bucket.params.dtype or p.device != bucket.params.device:
                    raise RuntimeError(
                        f"ShardedOptimizer: a parameter moved to {p.dtype} on {p.device} "
                        "after the optimizer was built; build the optimizer after moving "
                        "the model")
            bind(params, bucket.params, bucket.layout)
            bucket.pointers = [p.data_ptr() for p in params]

    # ------------------------------------------------------------------ bucket order
    def _learn_order(self) -> None:
        """Rebuild the buckets along rank 0's first-gradient order (once; collective)."""
        order = agree_on_order(self._observed, len(self.params), self.info.group)
        self._rebuild_along(order)

    @property
    def learned_order(self) -> list[int] | None:
        """The order the buckets follow since the first step (a permutation of the
        parameters' numbers), None before."""
        return None if self._order is None else list(self._order)

    def follow_order(self, order: list[int]) -> None:
        """Take ``order`` (a checkpoint's :attr:`learned_order`) as learned: the buckets are
        rebuilt along it now, and the first step learns nothing. Collective."""
        if sorted(order) != list(range(len(self.params))):
            raise ValueError(f"the gradient order must be a permutation of "
                             f"range({len(self.params)}), the parameters' numbers")
        self._rebuild_along(list(order))

    def _rebuild_along(self, order: list[int]) -> None:
        """Buckets cut along ``order``. A bucket of the same members is kept as it is;
        only the others are rebuilt."""
        self._observed = None
        self._order = order
        plan = assign_buckets(self._infos(self.params), self.bucket_size_mb, order,
                              self.bucket_rule)
        old = {frozenset(b.members): b for b in self.buckets}
        kept = [old.get(frozenset(members)) for members in plan]
        if all(bucket is not None for bucket in kept):
            self._index(kept)  # the same buckets: a new launch order only
        else:
            self._relayout(plan, kept)

    @torch.no_grad()
    def _relayout(self, plan: list[list[int]], kept: list[_Bucket | None]) -> None:
        """Buckets along ``plan``, reusing ``kept`` ones. The new ones take their
        parameters and stage 1's local gradients here; this step's averaged shards of
        the old buckets they replace are all-gathered one at a time and cut into the new
        shards (their size is sent once)."""
        new = [bucket or self._make_bucket(members) for members, bucket in zip(plan, kept)]
        where = {index: (bucket, j) for bucket, was in zip(new, kept) if was is None
                 for j, index in enumerate(bucket.members)}
        rank = self.info.rank
        for bucket in self.buckets:
            if any(bucket is k for k in kept):
                continue
            full = bucket.params.new_empty(bucket.layout.padded)
            full[bucket.layout.shard(rank)] = bucket.grad_shard
            for work in self.comm.all_gather(full, bucket.layout):
                work.wait()
            for index, offset, n in zip(bucket.members, bucket.layout.offsets,
                                        bucket.layout.numels):
                target, j = where[index]
                mine, start = target.layout.shard(rank), target.layout.offsets[j]
                lo, hi = max(start, mine.start), min(start + n, mine.stop)
                if lo < hi:
                    src = offset + lo - start
                    target.grad_shard[lo - mine.start : hi - mine.start] = full[
                        src : src + hi - lo]
        fresh = all(bucket.fresh for bucket in self.buckets)
        for bucket, was in zip(new, kept):
            if was is None:
                bucket.fresh = fresh
        self._index(new)
        self.layout_version += 1

    # ------------------------------------------------------------------ hooks
    def _register_hooks(self, first: int) -> None:
        this = weakref.ref(self)  # a discarded optimizer must not keep sending
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
        self._finished = False
        self._ready = [False] * len(self.params)
        self._remaining = [len(b.members) for b in self.buckets]
        self._next = 0
        torch.autograd.Variable._execution_engine.queue_callback(self._end_round)

    def _on_grad(self, index: int) -> None:
        """Parameter ``index``'s ``.grad`` was just updated by autograd."""
        if not self._used[index]:
            self._used[index] = True
            if self._observed is not None:
                self._observed.append(index)
        if not self.sync_enabled:
            return
        if not self._in_round:
            self._start_round()
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
                    self._send_bucket(self.buckets[n])
                    n += 1
            self._next = n

    def _end_round(self) -> None:
        """End of a synchronized backward: send the buckets still waiting, in order."""
        with torch.no_grad():
            for b in range(self._next, len(self.buckets)):
                self._send_bucket(self.buckets[b])
            if self.stage == 1:
                # A later backward of this step accumulates into the buffers being sent.
                self._complete_pending()
        self._next = len(self.buckets)
        self._in_round = False
        self._rounds += 1

    # ------------------------------------------------------------------ sending a bucket
    def _send_bucket(self, bucket: _Bucket) -> None:
        if self.stage == 1:
            self._send_stage1(bucket)
        else:
            self._send_stage2(bucket)

    def _send_stage1(self, bucket: _Bucket) -> None:
        """Stage 1: the members' ``.grad`` become views of the bucket's persistent
        gradients (keeping their values), and the bucket itself is reduced."""
        adopt_gradients([self.params[i] for i in bucket.members], bucket.views)
        send = bucket.grads
        key = self._key(bucket)
        if self.comm.scratches_input or key[0] != send.dtype:
            send = self._free_send_buffer(key)[: bucket.layout.padded]
            send.copy_(bucket.grads)
            self._send_pending[key] = self._start(bucket, send, direct=False)
            return
        # The first reduction of a step may land in the shard itself; a later one
        # (accumulation without no_sync) replaces it once done.
        self._start(bucket, send, direct=not bucket.sent)
        bucket.sent = True

    def _send_stage2(self, bucket: _Bucket) -> None:
        """Stage 2: the members' gradients are packed into the send buffer and dropped;
        the reduction adds into the shard (accumulation) unless the shard is fresh."""
        key = self._key(bucket)
        send = self._free_send_buffer(key)[: bucket.layout.padded]
        grads, targets, missing = [], [], []
        views = member_views(send, [self.params[i].shape for i in bucket.members],
                             bucket.layout)
        for index, view in zip(bucket.members, views):
            p = self.params[index]
            if p.grad is None:
                missing.append(view)
            else:
                grads.append(p.grad)
                targets.append(view)
                p.grad = None
        if targets:
            copy_all(targets, grads)
        if bucket.layout.padded > bucket.layout.numel:
            missing.append(send[bucket.layout.numel :])
        if missing:
            zero_all(missing)
        self._send_pending[key] = self._start(bucket, send, direct=bucket.fresh,
                                              accumulate=not bucket.fresh)
        bucket.fresh = False

    def _free_send_buffer(self, key: tuple[torch.dtype, torch.device]) -> torch.Tensor:
        """The send buffer of ``key``, once the reduction that last used it is done."""
        previous = self._send_pending.pop(key, None)
        if previous is not None:
            self._complete(previous)
        return self._send[key]

    def _start(self, bucket: _Bucket, send: torch.Tensor, *, direct: bool,
               accumulate: bool = False) -> _Reduction:
        """Start reducing ``send``; ``direct``: into the bucket's shard itself, where the
        dtype allows (else into a temporary, copied or, with ``accumulate``, added)."""
        out = bucket.grad_shard if direct and send.dtype == bucket.grad_shard.dtype else None
        works, output = self.comm.reduce_scatter(send, out, bucket.layout)
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
        if not self.comm.averages:
            r.output.div_(self.info.world_size)
        if r.output is not r.bucket.grad_shard:
            if r.accumulate:
                r.bucket.grad_shard.add_(r.output)
            else:
                r.bucket.grad_shard.copy_(r.output)

    def _complete_pending(self) -> None:
        for entry in self._pending:
            self._complete(entry)
        self._pending = []
        self._send_pending.clear()

    # ------------------------------------------------------------------ per step
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous = self.sync_enabled
        self.sync_enabled = False
        try:
            yield
        finally:
            self.sync_enabled = previous

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for this step's reductions and give each piece its averaged gradient, or
        None where no rank produced one (collective; idempotent until the next step).
        After the first step's, the buckets follow the learned order.

        A rank whose backward reached no parameter (or that ran none) sends zeros, so
        that every rank issues the same collectives."""
        if self._in_round:
            raise RuntimeError("ShardedOptimizer: the gradients were asked for during backward")
        if self._finished:
            return
        if not self.params:
            # Nothing to train (every parameter frozen, on every rank: they were checked to
            # agree): no reductions, no collectives, as torch.optim steps without gradients.
            self._finished = True
            return
        if self._rounds == 0:
            self._next = 0
            self._end_round()
        used = torch.tensor(self._used, dtype=torch.float32, device=self.buckets[0].params.device)
        flags = dist.all_reduce(used, group=self.info.group, async_op=True)
        self._complete_pending()
        flags.wait()
        if self._observed is not None:
            self._learn_order()
        nobody: set[int] = set()
        if not all(self._used):  # only a parameter unused here can be unused everywhere
            nobody = {i for i, count in enumerate(used.tolist()) if count == 0}
        self.unused = nobody
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
        works = [w for b in self.buckets for w in self.comm.all_gather(b.params, b.layout)]
        for work in works:
            work.wait()

    def spans(self) -> dict[int, list[tuple[int, int, int]]]:
        """``{id(param): [(rank, start, numel), ...]}``: which ranks' shards hold which
        part of each parameter, in the current buckets."""
        out = {}
        for bucket in self.buckets:
            for index, held in zip(bucket.members, bucket.layout.spans()):
                out[id(self.params[index])] = held
        return out

    def shard_gradients(self) -> list[torch.Tensor]:
        """This rank's averaged gradient buffers (padding is zero)."""
        return [b.grad_shard for b in self.buckets]

    def buffers(self) -> list[torch.Tensor]:
        """Every gradient buffer the path holds (for byte counts)."""
        out = [b.grad_shard for b in self.buckets]
        out += [b.grads for b in self.buckets if b.grads is not None]
        out += list(self._send.values())
        return out
