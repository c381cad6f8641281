"""The training step: one function, :func:`train_step`, that the trainer's loop and the
benchmarks (``apps/trainer/benchmarks/harness.py``) both call, so the step that is timed
is the step that trains.

Per step: this rank's micro-batches of the global batch; forward and backward under
autocast, inside ``no_sync`` for all micro-batches but the last; gradient averaging;
clipping by the global norm of the averaged gradients; the optimizer step. What wraps the
model (DDP wrapper, zero1's gradient hooks, FSDP2) is set up by
:func:`lab2_trainer.parallel.parallelize.parallelize`; the step goes through its ``Parallel``, whose
``no_sync``, ``finish`` and ``clip_grad_norm_`` are the right ones for every kind (with
zero1, zero2, zero3 and fsdp the model's ``.grad`` is not the averaged gradient, so the norm comes
from the optimizer or from the sharded gradients). Each rank's loss is the mean over its
equal slice, and the averaging across ranks then gives the mean over the global batch: the
same as one process on the whole batch.

Backward runs on the calling thread by default (:func:`backward_thread`): a rank drives
one device, so autograd's worker thread only adds a hand-over, and Python inside backward
(tritonnorm's backward, minddp's hooks) runs slower there (the README's
``--backward-thread`` section links the record).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from lab2_trainer.config import BACKWARD_THREADS, PRECISIONS
from lab2_trainer.parallel.parallelize import Parallel


def train_step(parallel: Parallel, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
               *, precision: str, device: torch.device, clip: float,
               scaler: torch.amp.GradScaler | None = None, backward_thread: str = "caller",
               mark: Callable[[str], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step of ``parallel`` on this rank's ``micro_batches``: the trainer's
    step, and the one the benchmarks time.

    Forward under autocast and backward per micro-batch (all but the last inside
    ``no_sync``), the gradient averaging (``finish``), clipping by the global norm of the
    averaged gradients, the optimizer step (through ``scaler`` for fp16), and the
    gradients set to None.

    Args:
        clip: the global norm to clip to (0: none, the norm is still measured).
        mark: called with "forward", "backward", "sync" and "optimizer" as each part ends
            (a benchmark's marks; the first two once per micro-batch).

    Returns:
        (this rank's mean loss, the gradient norm before clipping), tensors on the device.
    """
    optimizer = parallel.optimizer
    loss_sum = torch.zeros((), device=device)
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else parallel.no_sync():
            with autocast_context(precision, device):
                _, loss = parallel(x, y)
            if mark is not None:
                mark("forward")
            scaled = loss / len(micro_batches)
            if scaler is not None:
                scaled = scaler.scale(scaled)
            with backward_thread_context(backward_thread):
                scaled.backward()
            if mark is not None:
                mark("backward")
        loss_sum += loss.detach()
    parallel.finish()
    if mark is not None:
        mark("sync")
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = parallel.clip_grad_norm_(clip if clip > 0 else math.inf)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    if mark is not None:
        mark("optimizer")
    optimizer.zero_grad(set_to_none=True)
    return loss_sum / len(micro_batches), grad_norm


def autocast_context(precision: str, device: torch.device):
    """Autocast for bf16/fp16 on the rank's device; nothing for fp32 (``PRECISIONS``)."""
    dtype_name = PRECISIONS[precision]
    if dtype_name is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, dtype_name))


def set_lr(optimizer, lr: float) -> None:
    """Write ``lr`` into every param group (sharded optimizers pass it on at ``step``); an
    optimizer with a rate per part (Muon with AdamW) sets its own from it."""
    if hasattr(optimizer, "set_lr"):
        optimizer.set_lr(lr)
        return
    for group in optimizer.param_groups:
        group["lr"] = lr


# --------------------------------------------------------------------- backward thread
def backward_thread(kind: str) -> AbstractContextManager:
    """A context under which ``backward()`` runs on the thread ``kind`` names: "caller"
    (the thread that calls it) or "autograd" (PyTorch's device worker, its default).
    Affects the current thread only."""
    if kind not in BACKWARD_THREADS:
        raise ValueError(f"backward_thread must be one of {', '.join(BACKWARD_THREADS)}, "
                         f"got {kind!r}")
    return torch.autograd.set_multithreading_enabled(kind == "autograd")


# The step's own name for it (its argument ``backward_thread`` is the kind).
backward_thread_context = backward_thread
