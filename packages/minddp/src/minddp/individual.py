"""Data parallelism that all-reduces each parameter's gradient as soon as it exists."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from minddp.model_check import trainable_parameters
from minddp.overlap import DataParallelWrapper, StepState


class DDPIndividualParameters(DataParallelWrapper):
    """Overlap gradient communication with backward, one all-reduce per parameter.

    Each trainable parameter gets a post-accumulate-grad hook. When its gradient
    is complete, the hook starts an asynchronous all-reduce that averages it in place
    (see :class:`minddp.Averager`), so the gradients of late layers travel while
    autograd still computes earlier ones.

    Ordering guarantee. Gloo and NCCL pair collectives by the order they are
    issued, so every rank must issue the same all-reduces in the same order. Hook
    order is not reliable for that: a rank-dependent branch, an unused parameter or
    a module used in a different order than it was registered changes it. So the
    launch order is fixed: reverse registration order (the usual backward order)
    for the first step, then the order rank 0 saw gradients arrive in during that
    step (broadcast, so all ranks agree; see :func:`minddp.overlap.agree_on_order`).
    A hook only marks its parameter ready; the wrapper then launches the longest ready
    prefix of the fixed order. A parameter whose gradient arrives early waits for
    its predecessors; one that never arrives holds back the ones after it until
    ``finish_gradient_synchronization()``, which launches everything left, in
    order. Every rank therefore issues exactly the same sequence.

    Unused parameters. A parameter with no gradient on this rank is reduced as
    zeros. After the reduction one more all-reduce averages per-parameter "used" flags:
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

    def _on_ready(self, step: StepState, index: int) -> None:
        if self._position[index] == step.next:
            # Launch it and every ready one after it in the fixed order.
            order, ready = self._order, step.ready
            count = len(order)
            n = step.next
            while n < count and ready[order[n]]:
                self._launch(step, order[n])
                n += 1
            step.launched_in_backward += n - step.next
            step.next = n

    def _check_again(self, step: StepState, index: int) -> None:
        if self._position[index] < step.next:
            raise RuntimeError(
                f"DDPIndividualParameters: parameter {self._names[index]!r} received a "
                "gradient after its all-reduce had started (a second backward before "
                "finish_gradient_synchronization(), or a parameter reached twice, e.g. "
                "through reentrant checkpointing)"
            )

    def _launch(self, step: StepState, index: int) -> None:
        # Called with grad mode off: from a hook inside backward, or from the finish call.
        p = self._params[index]
        grad = p.grad
        if grad is None:
            grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
            p.grad = grad
            step.zero_filled[index] = True
        elif not grad.is_contiguous():
            grad = grad.contiguous()
            p.grad = grad
        step.handles.append(self._averager.start(grad))

    def _finish(self, start: float) -> None:
        # Launch every all-reduce still waiting, in order, then the used flags; wait.
        step = self._step
        while step.next < len(self._order):
            self._launch(step, self._order[step.next])
            step.next += 1
        flags = None
        if self._params:
            device = self._params[0].device
            if all(step.used):  # made on the device: no host-to-device copy
                flags = torch.ones(len(step.used), device=device)
            else:  # pageable memory, non_blocking: staged, without waiting for the GPU
                flags = torch.tensor(step.used, dtype=torch.float32).to(
                    device, non_blocking=True)
            # Averaged like the gradients: what matters is only whether a flag is 0.
            step.handles.append(self._averager.start(flags))
        wait = self._wait_for_handles()
        if flags is not None and any(step.zero_filled):
            for index, used_somewhere in enumerate(flags.tolist()):
                if step.zero_filled[index] and not used_somewhere:
                    self._params[index].grad = None  # nobody had a gradient: keep None
        self._end_synchronization(start, wait, launched=len(self._order))
