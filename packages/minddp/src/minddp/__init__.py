"""minddp: distributed data-parallel training from scratch over torch.distributed.

Four ways to average gradients across ranks, in order of speed:

* :func:`all_reduce_gradients` (``flat=False``): one all-reduce per parameter after backward.
* :func:`all_reduce_gradients` (``flat=True``): one all-reduce of all gradients packed together.
* :class:`DDPIndividualParameters`: per-parameter asynchronous all-reduces during backward.
* :class:`DDPBucketed`: bucketed asynchronous all-reduces during backward, gradients as
  views into the bucket buffers.

Modules: :mod:`minddp.allreduce` (the two baselines), :mod:`minddp.individual`,
:mod:`minddp.bucketed` (:class:`DDPBucketed`), :mod:`minddp.overlap` (what both
overlapping wrappers share, with the agreed launch order), :mod:`minddp.buckets` (the
bucket plan, no torch), :mod:`minddp.flat` (list-wide copies, flat packing, gradients as
bucket views), :mod:`minddp.comm` (process-group queries, averaging),
:mod:`minddp.broadcast` (broadcasting a module), :mod:`minddp.model_check` (checks that
every rank holds the same model). Their public names are documented in the README.

The names below are imported on first use, so that reading :data:`BUCKET_RULES` (a
command line's ``--help``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from minddp.buckets import BUCKET_RULES  # pure Python: no torch

__version__ = "0.7.0"

# The module that defines each public name.
_HOMES = {
    "Averager": "comm",
    "DDPBucketed": "bucketed",
    "DDPIndividualParameters": "individual",
    "ModelMismatchError": "model_check",
    "SyncStats": "overlap",
    "all_reduce_gradients": "allreduce",
    "broadcast_module": "broadcast",
    "check_model_consistency": "model_check",
    "model_signature": "model_check",
    "validate_bucket_rule": "buckets",
    "validate_bucket_size_mb": "buckets",
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
    from minddp.broadcast import broadcast_module
    from minddp.bucketed import DDPBucketed
    from minddp.buckets import validate_bucket_rule, validate_bucket_size_mb
    from minddp.comm import Averager
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
