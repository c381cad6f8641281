"""Data parallelism that all-reduces each parameter's gradient as soon as it exists."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from minddp._group import trainable_parameters
from minddp._wrapper import DataParallelWrapper


class DDPIndividualParameters(DataParallelWrapper):
    """Overlap gradient communication with backward, one all-reduce per parameter.

    Each trainable parameter gets a post-accumulate-grad hook. When its gradient
    is complete, the hook starts an asynchronous all-reduce that averages it in place
    (see :mod:`minddp.averaging`), so the gradients of late layers travel while
    autograd still computes earlier ones.

    Ordering guarantee. Gloo and NCCL pair collectives by the order they are
    issued, so every rank must issue the same all-reduces in the same order. Hook
    order is not reliable for that: a rank-dependent branch, an unused parameter or
    a module used in a different order than it was registered changes it. So the
    launch order is fixed: reverse registration order (the usual backward order)
    for the first step, then the order rank 0 saw gradients arrive in during that
    step (broadcast, so all ranks agree; see :mod:`minddp.launch_order`). A hook
    only marks its parameter ready; the wrapper then launches the longest ready
    prefix of the fixed order. A parameter whose gradient arrives early waits for
    its predecessors; one that never arrives holds back the ones after it until
    ``finish_gradient_synchronization()``, which launches everything left, in
    order. Every rank therefore issues exactly the same sequence.

    Unused parameters. A parameter with no gradient on this rank is reduced as
    zeros. After the reduction one more all-reduce sums per-parameter "used" flags:
    a parameter no rank used goes back to ``.grad = None`` (if it was None), as
    single-process training would leave it.

    Collectives rely on the process group's timeout: a dead or diverged peer turns
    into an error from ``finish_gradient_synchronization()`` after that timeout,
    never an endless hang.

    Args:
        module: the model, identical on every rank (checked, then broadcast from rank 0).
        process_group: the group to average over (default group when None).

    Use: ``loss = ddp(x).sum(); loss.backward(); ddp.finish_gradient_synchronization();
    optimizer.step()``.
    """

    def __init__(self, module: nn.Module, *, process_group: dist.ProcessGroup | None = None):
        super().__init__(module, process_group)
        named = trainable_parameters(module)
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        self._learn_order(list(reversed(range(len(self._params)))))
        self._register_grad_hooks(self._params)
        self._reset_step_state()

    def _learn_order(self, order: list[int]) -> None:
        self._order = order  # the fixed launch order, the same on every rank
        self._position = [0] * len(order)
        for position, index in enumerate(order):
            self._position[index] = position

    def _on_grad_ready(self, index: int) -> None:
        if not self._note_gradient(index):
            return
        if self._position[index] < self._next:
            raise RuntimeError(
                f"DDPIndividualParameters: parameter {self._names[index]!r} received a "
                "gradient after its all-reduce had started (a second backward before "
                "finish_gradient_synchronization(), or a parameter reached twice, e.g. "
                "through reentrant checkpointing)"
            )
        if self._ready[index]:
            return  # accumulated again before launch: fine, it goes out later
        self._ready[index] = True
        while self._next < len(self._order) and self._ready[self._order[self._next]]:
            self._launch(self._order[self._next])
            self._next += 1
            self._launched_in_backward += 1

    @torch.no_grad()
    def _launch(self, index: int) -> None:
        p = self._params[index]
        grad = p.grad
        if grad is None:
            grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
            p.grad = grad
            self._zero_filled[index] = True
        elif not grad.is_contiguous():
            grad = grad.contiguous()
            p.grad = grad
        self._handles.append(self._averager.start(grad))

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Wait for every gradient all-reduce; leave averaged gradients in ``.grad``.

        Call once per step on every rank, after backward and before the optimizer
        step (also on a rank whose loss did not touch the model). Inside
        ``no_sync()`` it does nothing.
        """
        if not self._sync_enabled:
            return
        start = time.perf_counter()
        while self._next < len(self._order):
            self._launch(self._order[self._next])
            self._next += 1
        flags = None
        if self._params:
            flags = torch.tensor(self._used, dtype=torch.float32, device=self._params[0].device)
            self._handles.append(dist.all_reduce(flags, group=self.process_group, async_op=True))
        wait = self._wait_for_handles()
        if flags is not None and any(self._zero_filled):
            for index, used_somewhere in enumerate(flags.tolist()):
                if self._zero_filled[index] and not used_somewhere:
                    self._params[index].grad = None  # nobody had a gradient: keep None
        self._end_synchronization(start, wait, launched=len(self._order))
