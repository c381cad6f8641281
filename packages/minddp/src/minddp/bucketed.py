"""Data parallelism with gradients packed into flat buckets, each all-reduced when full:
:class:`DDPBucketed`. Its buckets are cut by the bucket plan (:mod:`minddp.buckets`), and
each parameter's gradient lives in its bucket's flat buffer (:mod:`minddp.flat`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from minddp.buckets import TensorInfo, assign_buckets, validate_bucket_rule, validate_bucket_size_mb
from minddp.flat import adopt_gradients, copy_all, zero_all
from minddp.model_check import trainable_parameters
from minddp.overlap import DataParallelWrapper, StepState


@dataclass
class _Bucket:
    """One flat buffer: the members' gradients back to back, then one used flag each."""

    members: list[int]  # parameter indices, in buffer order
    params: list[nn.Parameter]  # the members themselves, in the same order
    views: list[torch.Tensor]  # each member's slice of the buffer, shaped like it
    buffer: torch.Tensor
    grads: torch.Tensor  # view of the buffer's head: the gradients, flat
    flags: torch.Tensor  # view of the buffer's tail, one element per member
    wire: torch.Tensor | None = None  # the buffer in reduce_dtype, when that differs


class DDPBucketed(DataParallelWrapper):
    """Overlap communication with backward, one all-reduce per bucket of gradients.

    Buckets. Trainable parameters are grouped, walking them in reverse registration
    order, into buckets of at most ``bucket_size_mb`` MiB of gradients per
    dtype/device (a larger parameter gets a bucket of its own; None: one bucket), or,
    with ``bucket_rule="reach"``, into buckets that close once they reach it (PyTorch
    DDP's rule: about half as many buckets, so half the per-bucket host work and
    collectives, each bucket up to one parameter over the cap).
    Each bucket owns one flat buffer, and each member's ``.grad`` becomes a view into
    it: the all-reduce runs on the buffer in place, and the optimizer reads the
    averaged gradients there, so nothing is copied out. Gradients autograd creates
    fresh (``.grad`` was None, as after ``zero_grad(set_to_none=True)``) are copied
    into their views when their bucket fills, the whole bucket's in one call: one read
    and one write per gradient, where zeroing the bucket before forward and letting
    autograd add into it costs four passes.
    Inside ``no_sync()`` each is copied in by its hook at once. Later accumulation into
    a view (``no_sync`` micro-steps, ``zero_grad(set_to_none=False)``) happens in place.

    Host time. The per-parameter hook only counts gradients in; copies, flags and the
    collective are per bucket (see ``benchmarks/host_time.py``).

    Ordering guarantee. When the last member of a bucket gets its gradient, the
    bucket's asynchronous averaging all-reduce starts (:class:`minddp.Averager`), but
    only once every earlier bucket has started: bucket i never goes out before
    bucket i-1. The bucket order is the same on every rank, so all ranks issue the
    same collectives in the same order even when their backward passes differ. The
    first step uses buckets cut along reverse registration order; after it, the
    buckets are rebuilt once along the order rank 0 saw gradients arrive in
    (broadcast, so all ranks agree; see :func:`minddp.overlap.agree_on_order`), as PyTorch's
    DDP does, so that bucket 0 really is the first to fill.

    Unused parameters. A bucket with a member that got no gradient (on this rank, or
    on any) cannot fill during backward; ``finish_gradient_synchronization()``
    launches every bucket still waiting, in order, with zeros for the missing
    gradients, so no rank waits for a collective the others never start. Each bucket
    carries one "used" flag per member at the end of its buffer; a member that no
    rank used gets ``.grad = None`` back (when it was None before), as
    single-process training would leave it. Frozen parameters are left out and tied
    parameters are counted once.

    Collectives rely on the process group's timeout: a dead or diverged peer turns
    into an error from ``finish_gradient_synchronization()`` after that timeout,
    never an endless hang.

    Args:
        module: the model, identical on every rank (checked, then broadcast from rank 0).
        bucket_size_mb: cap per bucket in MiB, or None for one bucket per dtype/device.
        process_group: the group to average over (default group when None).
        reduce_dtype: the dtype gradients travel and are averaged in; None: their own.
            ``torch.bfloat16`` halves the bytes of float32 gradients (what PyTorch
            DDP's ``bf16_compress_hook`` does): each bucket is cast into a bfloat16
            copy when it launches and cast back after the wait, so the averaged
            gradients carry bfloat16 rounding (relative error about 4e-3).
        bucket_rule: "at_most" (default: no bucket passes ``bucket_size_mb``) or "reach"
            (a bucket closes once it holds ``bucket_size_mb``); see Buckets above.

    Attributes:
        bucket_parameter_names: the parameter names of each bucket, in launch order.
        last_sync_stats: a :class:`~minddp.SyncStats` for the last finish call.
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_size_mb: float | None = 25.0,
        *,
        process_group: dist.ProcessGroup | None = None,
        reduce_dtype: torch.dtype | None = None,
        bucket_rule: str = "at_most",
    ):
        bucket_size_mb = validate_bucket_size_mb(bucket_size_mb)  # before any collective
        self.bucket_rule = validate_bucket_rule(bucket_rule)
        if reduce_dtype is not None and not (
            isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point
        ):
            raise TypeError(f"reduce_dtype must be a floating torch.dtype or None, "
                            f"got {reduce_dtype!r}")
        super().__init__(module, process_group)
        self.reduce_dtype = reduce_dtype
        self.bucket_size_mb = bucket_size_mb
        named = trainable_parameters(module)
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        self._infos = [
            TensorInfo(p.numel(), p.element_size(), (p.dtype, p.device)) for p in self._params
        ]
        self._build_buckets(assign_buckets(self._infos, self.bucket_size_mb,
                                           rule=self.bucket_rule))
        self._register_grad_hooks(self._params)
        self._reset_step_state()

    def _build_buckets(self, plan: list[list[int]]) -> None:
        """Allocate one flat buffer per bucket of ``plan``, moving existing grads in."""
        self._plan = plan
        self._buckets = [self._make_bucket(members) for members in plan]
        self._bucket_of = [0] * len(self._params)
        for b, members in enumerate(plan):
            for index in members:
                self._bucket_of[index] = b
        self._sizes = [len(members) for members in plan]
        self._views = [torch.empty(0)] * len(self._params)  # each parameter's bucket view
        for bucket in self._buckets:
            for index, view in zip(bucket.members, bucket.views):
                self._views[index] = view
        self._wired = [bucket for bucket in self._buckets if bucket.wire is not None]
        # Every flag is 1 between steps ("this rank used it"); a bucket launched with
        # unused members writes 0s for them, and the finish call sets all back at once.
        self._flags = [bucket.flags for bucket in self._buckets]
        self._ones = [torch.ones_like(flags) for flags in self._flags]
        self.bucket_parameter_names = [[self._names[i] for i in members] for members in plan]

    @torch.no_grad()
    def _make_bucket(self, members: list[int]) -> _Bucket:
        params = [self._params[i] for i in members]
        numel = sum(p.numel() for p in params)
        first = params[0]
        buffer = torch.zeros(numel + len(members), dtype=first.dtype, device=first.device)
        buffer[numel:] = 1
        views, offset = [], 0
        for p in params:
            view = buffer[offset : offset + p.numel()].view(p.shape)
            if p.grad is not None:  # keep a gradient the user already has
                view.copy_(p.grad)
                p.grad = view
            views.append(view)
            offset += p.numel()
        wire = None
        if self.reduce_dtype is not None and self.reduce_dtype != buffer.dtype:
            wire = torch.empty_like(buffer, dtype=self.reduce_dtype)
        return _Bucket(members=members, params=params, views=views, buffer=buffer,
                       grads=buffer[:numel], flags=buffer[numel:], wire=wire)

    def _bucket_sizes(self) -> list[int]:
        return self._sizes  # StepState.next counts launched buckets

    def _on_local(self, step: StepState, index: int) -> None:
        # no_sync: move a fresh gradient into its view now, so that the micro-steps
        # that follow accumulate in place and no second copy of it stays alive.
        p, view = self._params[index], self._views[index]
        grad = p.grad
        if grad is not view:
            view.copy_(grad)
            p.grad = view

    def _on_ready(self, step: StepState, index: int) -> None:
        b = self._bucket_of[index]
        remaining = step.remaining
        remaining[b] -= 1
        if remaining[b] != 0:
            return
        # Full: copy its fresh gradients in now (they are not kept alive until a bucket
        # before it fills), then launch it and every full one after it, if every bucket
        # before it is out: bucket i never goes out before bucket i-1, on every rank.
        self._adopt_gradients(step, self._buckets[b])
        if b == step.next:
            count = len(self._buckets)
            n = b
            while n < count and remaining[n] == 0:
                self._launch(step, n)
                n += 1
            step.launched_in_backward += n - step.next
            step.next = n

    def _check_again(self, step: StepState, index: int) -> None:
        b = self._bucket_of[index]
        if b < step.next:
            raise RuntimeError(
                f"DDPBucketed: parameter {self._names[index]!r} received a gradient after "
                f"its bucket ({b}) had been launched (a second backward before "
                "finish_gradient_synchronization(), or a parameter reached twice, e.g. "
                "through reentrant checkpointing)"
            )

    def _adopt_gradients(self, step: StepState, bucket: _Bucket) -> None:
        """Make every member's ``.grad`` its bucket view, keeping what it holds
        (:func:`adopt_gradients`); note the members that had none."""
        zero_filled = step.zero_filled
        for j in adopt_gradients(bucket.params, bucket.views, bucket.grads):
            zero_filled[bucket.members[j]] = True

    def _launch(self, step: StepState, b: int, unused: list[int] | None = None) -> None:
        """Start bucket ``b``'s averaging; its members' ``.grad`` are its views already.
        ``unused``: positions in the bucket of the members this rank did not use (their
        flags become 0; the others are 1)."""
        bucket = self._buckets[b]
        if unused:
            # Views of the flags, not a tensor built on the host: no host-to-device copy.
            zero_all([bucket.flags[j : j + 1] for j in unused])
        if bucket.wire is None:
            step.handles.append(self._averager.start(bucket.buffer))
        else:
            bucket.wire.copy_(bucket.buffer)
            step.handles.append(self._averager.start(bucket.wire))

    def _learn_order(self, order: list[int]) -> None:
        """Rebuild the buckets along the gradient order rank 0 observed (once)."""
        plan = assign_buckets(self._infos, self.bucket_size_mb, order, self.bucket_rule)
        if plan != self._plan:  # same on every rank: all ranks agreed on ``order``
            self._build_buckets(plan)

    def _finish(self, start: float) -> None:
        # Launch the buckets still waiting, in order; wait for all.
        step = self._step
        used = step.used
        partly_used = []
        for b in range(step.next, len(self._buckets)):
            # A member may have no gradient this step, or one the user assigned since
            # its hook ran (between no_sync backwards): _launch gives each its view.
            bucket = self._buckets[b]
            self._adopt_gradients(step, bucket)
            unused = [j for j, index in enumerate(bucket.members) if not used[index]]
            self._launch(step, b, unused)
            if unused:
                partly_used.append(b)
        wait = self._wait_for_handles()
        if self._wired:
            copy_all([bucket.buffer for bucket in self._wired],
                     [bucket.wire for bucket in self._wired])
        # Only a bucket this rank did not fully use can hold a parameter nobody used.
        # Other ranks' unused members changed the flags of any bucket: reset them all.
        for b in partly_used:
            bucket = self._buckets[b]
            for index, used_somewhere in zip(bucket.members, bucket.flags.tolist()):
                if step.zero_filled[index] and not used_somewhere:
                    self._params[index].grad = None  # nobody had a gradient: keep None
        copy_all(self._flags, self._ones)
        self._end_synchronization(start, wait, launched=len(self._buckets))
