"""What every variant's communication starts from: process-group queries (an initialized
group, its size, this rank, global ranks) and the in-place averaging all-reduce
(:class:`Averager`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


# ------------------------------------------------------------------ process group
def require_initialized() -> None:
    """Raise a clear error when torch.distributed has no default process group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "minddp needs an initialized process group: call "
            "torch.distributed.init_process_group(...) before using it"
        )


def group_size(process_group: dist.ProcessGroup | None) -> int:
    """World size of ``process_group`` (the default group when None)."""
    require_initialized()
    return dist.get_world_size(group=process_group)


def group_rank(process_group: dist.ProcessGroup | None) -> int:
    """This process's rank inside ``process_group`` (the default group when None)."""
    require_initialized()
    return dist.get_rank(group=process_group)


def global_rank_of(process_group: dist.ProcessGroup | None, rank_in_group: int) -> int:
    """Translate a rank inside ``process_group`` to the global rank collectives expect."""
    if process_group is None or process_group is dist.GroupMember.WORLD:
        return rank_in_group
    get = getattr(dist, "get_global_rank", None) or dist.distributed_c10d._get_global_rank
    return get(process_group, rank_in_group)


# ------------------------------------------------------------------ averaging
# One asynchronous in-place all-reduce that leaves the average, launched from inside
# backward: NCCL averages natively (no division pass), Gloo divides first then sums; the
# group object is called directly with options built once (no per-call argument checks);
# a group of one launches nothing. The figures: docs/benchmarks/README.md (host time).
class _Done:
    """The handle of an average that needed no collective (a group of one)."""

    __slots__ = ()

    def wait(self, timeout: object = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


_DONE = _Done()


class Averager:
    """Averages tensors over a process group, one asynchronous all-reduce each.

    Args:
        process_group: the group to average over (default group when None).

    Attributes:
        world_size: size of the group.
        native_average: True when the backend averages in the collective itself.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.world_size = group_size(process_group)
        self._group = process_group if process_group is not None else dist.group.WORLD
        avg = getattr(dist.ReduceOp, "AVG", None)
        self.native_average = avg is not None and dist.get_backend(process_group) == "nccl"
        self._op = avg if self.native_average else dist.ReduceOp.SUM
        self._options = None
        if hasattr(dist, "AllreduceOptions") and hasattr(self._group, "allreduce"):
            self._options = dist.AllreduceOptions()
            self._options.reduceOp = self._op

    def start(self, tensor: torch.Tensor) -> dist.Work:
        """Begin averaging ``tensor`` in place; ``wait()`` on the result before reading it."""
        if self.world_size == 1:
            return _DONE  # type: ignore[return-value]
        if not self.native_average and self.world_size > 1:
            tensor.div_(self.world_size)
        if self._options is not None:
            return self._group.allreduce([tensor], self._options)
        return dist.all_reduce(tensor, op=self._op, group=self._group, async_op=True)
