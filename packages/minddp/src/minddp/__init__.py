"""minddp: distributed data-parallel training from scratch over torch.distributed.

Four ways to average gradients across ranks, in order of speed:

* :func:`all_reduce_gradients` (``flat=False``): one all-reduce per parameter after backward.
* :func:`all_reduce_gradients` (``flat=True``): one all-reduce of all gradients packed together.
* :class:`DDPIndividualParameters`: per-parameter asynchronous all-reduces during backward.
* :class:`DDPBucketed`: bucketed asynchronous all-reduces during backward, gradients as
  views into the bucket buffers.

Modules: :mod:`minddp.allreduce` (the two baselines), :mod:`minddp.individual`,
:mod:`minddp.bucketed` (with the bucket plan), :mod:`minddp.overlap` (what both overlapping
wrappers share), :mod:`minddp.comm` (process-group queries, averaging, broadcasting a
module), :mod:`minddp.model_check` (checks that every rank holds the same model).
:mod:`minddp._internal` holds what zero1 builds on (the bucket plan, list-wide copies);
it is not public API.

The names below are imported on first use, so that reading :data:`BUCKET_RULES` (a
command line's ``--help``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.6.0"

#: How a cap cuts buckets: "at_most" never lets a bucket pass the cap (a parameter that
#: would push it past opens the next one); "reach" closes a bucket once it reaches the
#: cap, so each holds at least the cap but the last of a group, up to one parameter over
#: it (PyTorch DDP's rule, which makes about half as many buckets).
BUCKET_RULES = ("at_most", "reach")

# The module that defines each public name.
_HOMES = {
    "Averager": "comm",
    "DDPBucketed": "bucketed",
    "DDPIndividualParameters": "individual",
    "ModelMismatchError": "model_check",
    "SyncStats": "overlap",
    "all_reduce_gradients": "allreduce",
    "broadcast_module": "comm",
    "check_model_consistency": "model_check",
    "model_signature": "model_check",
    "validate_bucket_rule": "bucketed",
    "validate_bucket_size_mb": "bucketed",
}

__all__ = [
    "BUCKET_RULES",
    "Averager",
    "DDPBucketed",
    "DDPIndividualParameters",
    "ModelMismatchError",
    "SyncStats",
    "all_reduce_gradients",
    "broadcast_module",
    "check_model_consistency",
    "model_signature",
    "validate_bucket_rule",
    "validate_bucket_size_mb",
]

if TYPE_CHECKING:
    from minddp.allreduce import all_reduce_gradients
    from minddp.bucketed import DDPBucketed, validate_bucket_rule, validate_bucket_size_mb
    from minddp.comm import Averager, broadcast_module
    from minddp.individual import DDPIndividualParameters
    from minddp.model_check import ModelMismatchError, check_model_consistency, model_signature
    from minddp.overlap import SyncStats


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'minddp' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"minddp.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
