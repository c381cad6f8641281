"""The bookkeeping of one synchronized step, in a plain object.

The wrappers are ``nn.Module``s, and every attribute assignment on a module goes through
``nn.Module.__setattr__`` (checks for parameters, submodules and buffers: about 1 µs
each, measured with cProfile). Gradient hooks update this state once per parameter per
backward, so it lives here, where an assignment is a slot store.
"""

from __future__ import annotations

import torch.distributed as dist


class StepState:
    """What hooks and the finish call update during one synchronized step.

    Args:
        count: number of trainable parameters.
        bucket_sizes: members per bucket (bucketed wrapper), else empty.

    Attributes:
        used: per parameter, a hook fired since the last synchronization (no_sync
            backwards included).
        ready: per parameter, a hook fired in the current synchronized backward.
        zero_filled: per parameter, ``.grad`` was None and zeros were reduced instead.
        remaining: per bucket, members whose gradient has not arrived yet.
        handles: work handles of the collectives launched so far, in launch order.
        next: collectives (parameters or buckets) ``[0, next)`` of the fixed order are
            launched.
        launched_in_backward: of those, how many hooks launched.
        backward_seen: a synchronized backward reached a hook since the last finish.
    """

    __slots__ = ("used", "ready", "zero_filled", "remaining", "handles", "next",
                 "launched_in_backward", "backward_seen")

    def __init__(self, count: int, bucket_sizes: list[int]) -> None:
        self.used = [False] * count
        self.ready = [False] * count
        self.zero_filled = [False] * count
        self.remaining = list(bucket_sizes)
        self.handles: list[dist.Work] = []
        self.next = 0
        self.launched_in_backward = 0
        self.backward_seen = False
