"""Copy or zero a list of tensors in one call.

Inside backward every tensor operation costs host time in the thread that drives the
GPU, and a Python loop of ``copy_`` calls pays the dispatcher once per tensor (about
2 µs each on a CPU, a kernel launch each on CUDA). ``torch._foreach_*`` does the whole
list in one call: one loop in C++ on the CPU, one or a few multi-tensor kernels on CUDA.
"""

from __future__ import annotations

import torch

_copy = getattr(torch, "_foreach_copy_", None)
_zero = getattr(torch, "_foreach_zero_", None)


def copy_all(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``d.copy_(s)`` for every pair (same shapes, dtypes and devices pairwise)."""
    if _copy is not None and len(destinations) > 1:  # one tensor: copy_ has less to check
        _copy(destinations, sources)
        return
    for d, s in zip(destinations, sources):
        d.copy_(s)


def zero_all(tensors: list[torch.Tensor]) -> None:
    """``t.zero_()`` for every tensor."""
    if _zero is not None and len(tensors) > 1:
        _zero(tensors)
        return
    for t in tensors:
        t.zero_()
