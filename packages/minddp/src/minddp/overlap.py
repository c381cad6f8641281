"""What both overlapping wrappers (:mod:`minddp.individual`, :mod:`minddp.bucketed`)
share: construction checks, forward, ``no_sync``, the gradient hooks, the agreed launch
order, and the per-step bookkeeping around their collectives.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from minddp.broadcast import broadcast_module
from minddp.comm import Averager, global_rank_of, group_size, require_initialized
from minddp.model_check import check_model_consistency


# ------------------------------------------------------------------ per-step state
@dataclass
class SyncStats:
    """What the last ``finish_gradient_synchronization`` call cost (benchmarks read it).

    Attributes:
        finish_seconds: wall time of the whole ``finish_gradient_synchronization`` call.
        wait_seconds: part of it spent blocked on outstanding collectives.
        launched_in_backward: collectives started by gradient hooks during backward.
        launched_in_finish: collectives that had to wait until the finish call
            (unused parameters, or hooks that fired out of the fixed order).
    """

    finish_seconds: float = 0.0
    wait_seconds: float = 0.0
    launched_in_backward: int = 0
    launched_in_finish: int = 0


# Hooks update this once per parameter per backward: a slotted object, not attributes of
# the wrapper, whose ``nn.Module.__setattr__`` costs a microsecond each.
class StepState:
    """What hooks and the finish call update during one synchronized step.

    Args:
        count: number of trainable parameters.
        bucket_sizes: members per bucket (bucketed wrapper), else empty.

    Attributes:
        used: per parameter, a hook fired since the last synchronization (no_sync
            backwards included).
        ready: per parameter, a hook fired in the current synchronized backward.
        zero_filled: per parameter, ``.grad`` was None and zeros were reduced instead.
        remaining: per bucket, members whose gradient has not arrived yet.
        handles: work handles of the collectives launched so far, in launch order.
        next: collectives (parameters or buckets) ``[0, next)`` of the fixed order are
            launched.
        launched_in_backward: of those, how many hooks launched.
        backward_seen: a synchronized backward reached a hook since the last finish.
    """

    __slots__ = ("used", "ready", "zero_filled", "remaining", "handles", "next",
                 "launched_in_backward", "backward_seen")

    def __init__(self, count: int, bucket_sizes: list[int]) -> None:
        self.used = [False] * count
        self.ready = [False] * count
        self.zero_filled = [False] * count
        self.remaining = list(bucket_sizes)
        self.handles: list[dist.Work] = []
        self.next = 0
        self.launched_in_backward = 0
        self.backward_seen = False


# ------------------------------------------------------------------ launch order
# Collectives go out along one order, the same on every rank: reverse registration order
# in the first step, then the order rank 0 saw gradients arrive in (broadcast).
def agree_on_order(
    observed: list[int], count: int, process_group: dist.ProcessGroup | None
) -> list[int]:
    """Rank 0's observed arrival order, completed to a permutation of ``range(count)``.

    Collective: every rank of the group must call it at the same point.

    Args:
        observed: parameter indices in the order their first gradient arrived here.
        count: number of parameters.
        process_group: the group to agree over (default group when None).

    Returns:
        Rank 0's ``observed``, then the indices it never saw, in reverse order.
    """
    if group_size(process_group) > 1:
        message = [list(observed)]
        dist.broadcast_object_list(
            message, src=global_rank_of(process_group, 0), group=process_group
        )
        observed = message[0]
    seen = set(observed)
    return list(observed) + [i for i in reversed(range(count)) if i not in seen]


# ------------------------------------------------------------------ the base class
class DataParallelWrapper(nn.Module):
    """Base class: holds ``.module``, syncs it at construction, owns the hook plumbing.

    Subclasses set ``self._params`` (the trainable parameters, in registration order),
    implement ``_on_ready(step, index)`` (a parameter's gradient is complete for the
    first time in this synchronized backward: count it, launch what can go), may
    implement ``_on_local(step, index)`` (the same inside ``no_sync()``),
    ``_check_again(step, index)`` (the same gradient was accumulated again: raise if it
    is already on the wire), ``_learn_order(order)`` and ``_finish(start)`` (the body
    of ``finish_gradient_synchronization()``, which ends with ``_end_synchronization``),
    and may override ``_bucket_sizes()``. The per-step state is ``self._step``, a
    :class:`StepState`. The hook does list lookups and stores only (it delays the
    backward's kernels); tensor work happens once per bucket.
    """

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        require_initialized()
        self.module = module
        self.process_group = process_group
        self.world_size = group_size(process_group)
        # Compare first: broadcasting into a mismatched model would hang or corrupt.
        check_model_consistency(module, process_group=process_group)
        broadcast_module(module, 0, process_group=process_group)
        self._averager = Averager(process_group)
        self._sync_enabled = True
        self._hook_handles: list[Any] = []
        self.last_sync_stats = SyncStats()
        self._order_learned = False
        self._observed: list[int] = []  # first-gradient arrival order, until learned
        self._gradient_order: list[int] | None = None  # the agreed order, once learned

    def _register_grad_hooks(self, params: list[nn.Parameter]) -> None:
        # A post-accumulate-grad hook per parameter, the cheapest way to learn that a
        # gradient is complete (docs/benchmarks/README.md, host time). It holds the wrapper
        # weakly: a discarded wrapper must not keep launching collectives.
        this = weakref.ref(self)
        for index, p in enumerate(params):

            def hook(_param: torch.Tensor, index: int = index) -> None:
                wrapper = this()
                if wrapper is not None:
                    wrapper._on_grad_ready(index)

            self._hook_handles.append(p.register_post_accumulate_grad_hook(hook))

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the wrapped module's parameters."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()

    def _on_grad_ready(self, index: int) -> None:
        """Parameter ``index``'s ``.grad`` was just updated by autograd."""
        step = self._step
        used = step.used
        if not used[index]:
            used[index] = True
            if not self._order_learned:
                self._observed.append(index)
        if not self._sync_enabled:
            if torch.is_grad_enabled():
                with torch.no_grad():
                    self._on_local(step, index)
            else:
                self._on_local(step, index)
            return
        ready = step.ready
        if ready[index]:
            self._check_again(step, index)  # accumulated twice: fine unless already out
            return
        ready[index] = True
        step.backward_seen = True
        if torch.is_grad_enabled():  # backward(create_graph=True): keep our copies out
            with torch.no_grad():
                self._on_ready(step, index)
        else:
            self._on_ready(step, index)

    def _on_local(self, step: StepState, index: int) -> None:
        """A gradient accumulated inside ``no_sync()`` (nothing to launch)."""

    def _on_ready(self, step: StepState, index: int) -> None:
        raise NotImplementedError

    def _check_again(self, step: StepState, index: int) -> None:
        raise NotImplementedError

    def _learn_order(self, order: list[int]) -> None:
        """Adopt ``order`` (agreed by every rank) as the gradient arrival order."""
        raise NotImplementedError

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Launch what is still waiting, wait for every collective; leave the averaged
        gradients in ``.grad``.

        Call once per step on every rank, after backward and before the optimizer
        step (also on a rank whose loss did not touch the model).

        Raises:
            RuntimeError: called inside ``no_sync()``, where nothing is averaged: call
                it after the backward that runs outside the context.
        """
        if not self._sync_enabled:
            raise RuntimeError(
                f"{type(self).__name__}.finish_gradient_synchronization() was called inside "
                "no_sync(), where gradients only accumulate locally and nothing is averaged; "
                "call it after the backward that runs outside no_sync()"
            )
        self._finish(time.perf_counter())

    def _finish(self, start: float) -> None:
        """The work of :meth:`finish_gradient_synchronization` (synchronization is on);
        ends with ``_end_synchronization(start, ...)``."""
        raise NotImplementedError

    def _bucket_sizes(self) -> list[int]:
        """Members per bucket, for ``StepState.remaining`` (none without buckets)."""
        return []

    def _reset_step_state(self) -> None:
        self._step = StepState(len(self._params), self._bucket_sizes())

    @property
    def _handles(self) -> list[dist.Work]:
        """Work handles of the collectives launched since the last finish call."""
        return self._step.handles

    def _before_forward(self) -> None:
        """Refuse a forward between a synchronized backward and its finish call."""
        if self._step.backward_seen and torch.is_grad_enabled():
            raise self._unfinished_error()

    def _wait_for_handles(self) -> float:
        """Wait for every launched collective; the seconds spent blocked."""
        start = time.perf_counter()
        for handle in self._step.handles:
            handle.wait()
        return time.perf_counter() - start

    def _end_synchronization(self, start: float, wait: float, launched: int) -> None:
        """Learn the launch order (after the first step), reset, record ``last_sync_stats``.

        Args:
            start: ``time.perf_counter()`` when the finish call began.
            wait: seconds it spent blocked on collectives.
            launched: collectives this step launched in all.
        """
        launched_in_backward = self._step.launched_in_backward
        if not self._order_learned:  # once, after the first synchronized step
            self._adopt_order(
                agree_on_order(self._observed, len(self._params), self.process_group)
            )
        self._reset_step_state()
        self.last_sync_stats = SyncStats(
            finish_seconds=time.perf_counter() - start,
            wait_seconds=wait,
            launched_in_backward=launched_in_backward,
            launched_in_finish=launched - launched_in_backward,
        )

    def _adopt_order(self, order: list[int]) -> None:
        self._learn_order(order)
        self._gradient_order = list(order)
        self._order_learned = True
        self._observed = []

    @property
    def gradient_order(self) -> list[int] | None:
        """The gradient arrival order the wrapper launches along (indices of the trainable
        parameters in registration order), learned after the first synchronized step or
        set by :meth:`set_gradient_order`; None before either. Save it with a checkpoint:
        a resumed run that sets it launches exactly as the interrupted one did."""
        return None if self._gradient_order is None else list(self._gradient_order)

    def set_gradient_order(self, order: list[int]) -> None:
        """Launch along ``order`` from the next step on, instead of learning it.

        ``order`` is a :attr:`gradient_order` of the same model (a permutation of the
        trainable parameters' indices). Call it on every rank with the same order,
        between steps. This is what makes a resumed run bitwise the same as one that was
        never interrupted: the learned order fixes the buckets, and the buckets fix the
        order in which a collective sums each element.

        Raises:
            ValueError: ``order`` is not a permutation of ``range(len(parameters))``.
            RuntimeError: called between a synchronized backward and its finish call.
        """
        count = len(self._params)
        order = [int(i) for i in order]
        if sorted(order) != list(range(count)):
            raise ValueError(f"order must be a permutation of range({count}) (the trainable "
                             f"parameters' indices), got {order}")
        if self._step.backward_seen:
            raise self._unfinished_error()
        self._adopt_order(order)
        self._reset_step_state()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module's forward with every argument unchanged."""
        self._before_forward()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip communication for the backward passes run inside this context.

        Gradients accumulate locally; the next backward outside the context,
        followed by ``finish_gradient_synchronization()``, averages the accumulated
        sum. ``finish_gradient_synchronization()`` called inside the context raises
        ``RuntimeError``.
        """
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def _unfinished_error(self) -> RuntimeError:
        return RuntimeError(
            f"{type(self).__name__}: a backward pass ran since the last "
            "finish_gradient_synchronization(); call it (on every rank) after each "
            "synchronized backward and before the next forward, or run accumulation "
            "steps inside no_sync()"
        )
