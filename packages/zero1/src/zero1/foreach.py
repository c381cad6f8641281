"""The local optimizer's implementation: foreach kernels for a shard's groups where they
pay on the CPU (PyTorch picks them on CUDA only); the same arithmetic, without the Python
loop over tensors. Invisible in ``param_groups`` and state dicts; a group or a user that
names ``foreach``, ``fused`` or ``differentiable`` keeps its choice.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.optim import Optimizer

_IMPLEMENTATION_KEYS = ("foreach", "fused", "differentiable")


def local_choices(optimizer_cls: type[Optimizer], defaults: dict[str, Any]) -> dict[str, Any]:
    """Implementation options the local optimizer's groups may get on top of the user's.

    ``foreach=True`` when the class takes it and the user chose no implementation
    (``foreach``, ``fused``) and no ``differentiable`` step: PyTorch's own default picks
    foreach kernels on CUDA only, which leaves a Python loop over parameters on the CPU.
    The result is the same arithmetic; only the loop goes. Only groups where it pays get
    it (:func:`foreach_pays`), and not a group that names one of these options itself
    (see :func:`choices_for`).

    Returns:
        ``{option: value}`` for the local optimizer (empty when nothing is chosen).
    """
    try:
        accepted = inspect.signature(optimizer_cls.__init__).parameters
    except (TypeError, ValueError):
        return {}
    if "foreach" not in accepted:
        return {}
    if any(defaults.get(k) for k in _IMPLEMENTATION_KEYS) or defaults.get("foreach") is not None:
        return {}
    return {"foreach": True}


# Foreach kernels pay on the CPU only where tensors are small, or all of them fit in
# cache (one pass over every tensor per operation, against the loop's one tensor at a
# time in cache); the thresholds and their figures: docs/benchmarks/README.md.
FOREACH_MAX_MEAN_NUMEL = 4096
FOREACH_MAX_TOTAL_NUMEL = 1 << 19


def foreach_pays(params: list[torch.Tensor]) -> bool:
    """Whether a local group of ``params`` steps faster with foreach kernels than with the
    per-tensor loop: they average at most ``FOREACH_MAX_MEAN_NUMEL`` elements, or hold at
    most ``FOREACH_MAX_TOTAL_NUMEL`` in all (so an empty group does too)."""
    total = sum(p.numel() for p in params)
    return total <= FOREACH_MAX_TOTAL_NUMEL or total <= FOREACH_MAX_MEAN_NUMEL * len(params)


def choices_for(group: dict[str, Any], choices: dict[str, Any],
                 pays: bool) -> dict[str, Any]:
    """``choices`` for one group where foreach ``pays`` (``foreach_pays`` of its local
    tensors), unless the group picks an implementation itself (a ``foreach`` that is not
    None, ``fused`` or ``differentiable``); else nothing, and PyTorch's default applies."""
    if not pays:
        return {}
    if group.get("foreach") is not None or group.get("fused") or group.get("differentiable"):
        return {}
    return choices
