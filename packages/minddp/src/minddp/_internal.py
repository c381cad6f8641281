"""Pieces of minddp that zero1 builds on; not part of minddp's public API.

The bucket plan (:func:`assign_buckets` over :class:`TensorInfo`), the agreed gradient
order (:func:`agree_on_order`), gradients turned into views of a bucket
(:func:`adopt_gradients`) and the list-wide copies (:func:`copy_all`, :func:`zero_all`).
They may change with minddp; zero1 pins the minddp it is tested with.
"""

from minddp.bucketed import TensorInfo, adopt_gradients, assign_buckets
from minddp.comm import copy_all, zero_all
from minddp.overlap import agree_on_order

__all__ = ["TensorInfo", "adopt_gradients", "agree_on_order", "assign_buckets", "copy_all",
           "zero_all"]
