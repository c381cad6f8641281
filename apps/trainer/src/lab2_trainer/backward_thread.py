"""Which thread runs ``backward()``: the caller's, or PyTorch's worker for the device.

By default autograd runs the backward of CUDA tensors on a worker thread per device while
the calling thread waits. A rank of this trainer drives one device, so the worker gains
nothing; and Python code inside backward (a Python ``autograd.Function``'s backward, such
as tritonnorm's, and gradient hooks, such as minddp's) runs there on a thread whose caches
hold none of the interpreter's state, after a hand-over each way. The trainer therefore
runs backward on the caller (measured in
``apps/trainer/docs/benchmarks/2026-12-01-h200-backward-thread.md``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from lab2_trainer.settings import BACKWARD_THREADS


def backward_thread(kind: str) -> AbstractContextManager:
    """A context under which ``backward()`` runs on the thread ``kind`` names: "caller"
    (the thread that calls it) or "autograd" (PyTorch's device worker, its default).
    Affects the current thread only."""
    if kind not in BACKWARD_THREADS:
        raise ValueError(f"backward_thread must be one of {', '.join(BACKWARD_THREADS)}, "
                         f"got {kind!r}")
    import torch

    return torch.autograd.set_multithreading_enabled(kind == "autograd")
