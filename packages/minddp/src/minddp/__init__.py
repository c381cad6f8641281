"""minddp: distributed data-parallel training from scratch over torch.distributed.

Four ways to average gradients across ranks, in order of speed:

* :func:`all_reduce_gradients` (``flat=False``): one all-reduce per parameter after backward.
* :func:`all_reduce_gradients` (``flat=True``): one all-reduce of all gradients packed together.
* :class:`DDPIndividualParameters`: per-parameter asynchronous all-reduces during backward.
* :class:`DDPBucketed`: bucketed asynchronous all-reduces during backward, gradients as
  views into the bucket buffers.
"""

from minddp._bulk import copy_all, zero_all
from minddp.allreduce import all_reduce_gradients
from minddp.averaging import Averager
from minddp.broadcast import broadcast_module
from minddp.bucket_plan import BUCKET_RULES, TensorInfo, assign_buckets
from minddp.bucketed import DDPBucketed
from minddp.individual import DDPIndividualParameters
from minddp.model_check import ModelMismatchError, check_model_consistency, model_signature
from minddp.stats import SyncStats

__version__ = "0.4.1"

__all__ = [
    "BUCKET_RULES",
    "Averager",
    "DDPBucketed",
    "DDPIndividualParameters",
    "ModelMismatchError",
    "SyncStats",
    "TensorInfo",
    "all_reduce_gradients",
    "assign_buckets",
    "broadcast_module",
    "check_model_consistency",
    "copy_all",
    "model_signature",
    "zero_all",
]
