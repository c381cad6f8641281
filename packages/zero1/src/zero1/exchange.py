"""The broadcast path (``reduce_gradients=False``): who owns which whole parameter, and
the parameter exchange after each step, one broadcast per rank and bucket.

Ownership: greedy, largest first onto the least-loaded rank
(:func:`partition_parameters`). This is a pure function of sizes, so every rank computes
the same answer without talking to the others, and it can be tested without a process
group.

The exchange: every parameter is rebound (``p.data = view``) to a slice of a flat
segment, one segment per (device, dtype) and owning rank, so the parameters one rank owns
are contiguous. After the local optimizer has updated its parameters in place, the
owner's segment already holds the new values; broadcasting each rank's segment from
its owner brings every rank up to date, with no copies and no allocation per step.
That is ``world_size`` broadcasts per (device, dtype), usually ``world_size`` in
total, instead of one per parameter.

Segments are allocated one at a time, and each parameter's old storage is released
as soon as it is rebound, so building them costs at most one segment (about 1/N of
the parameters) of extra memory, not a second copy of the model.

Rebinding ``.data`` keeps each ``Parameter`` object (modules, gradients and hooks see
the same tensor), but code holding the *old* storage (say, a ``state_dict()`` taken
before the optimizer was built) no longer sees updates. If anything rebinds a
parameter afterwards (``model.to(...)``, ``p.data = ...``), ``ensure_bound`` notices
the changed pointer and rebuilds the buffers from the parameters' current values.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


# ------------------------------------------------------------------ ownership
def partition_parameters(
    sizes: Sequence[int], world_size: int, loads: Sequence[int] | None = None
) -> tuple[list[int], list[int]]:
    """Assign whole parameters to ranks, balancing the total size each rank owns.

    Parameters are taken largest first (ties: the earlier one first) and each goes to
    the rank with the smallest load so far (ties: the lower rank). Passing the loads a
    previous call returned continues the balance, which is how later parameter groups
    and ``add_param_group`` keep the whole model balanced rather than each group alone.

    Because a parameter always lands on a rank whose load is at most the mean of what
    has been placed, no rank ends above ``sum(sizes) / world_size + max(sizes)`` (plus
    the imbalance already present in ``loads``).

    Args:
        sizes: one non-negative size per parameter (bytes or elements), in group order.
        world_size: number of ranks, at least 1.
        loads: each rank's load before this call; zeros when omitted.

    Returns:
        ``(owners, loads)``: the owning rank of each parameter, in the order of
        ``sizes``, and each rank's load afterwards.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    start = [0] * world_size if loads is None else [int(x) for x in loads]
    if len(start) != world_size:
        raise ValueError(f"loads has {len(start)} entries for world_size {world_size}")
    if any(s < 0 for s in sizes):
        raise ValueError(f"sizes must be non-negative, got {list(sizes)}")

    # A heap of (load, rank) pops the least-loaded rank, the lowest rank among equals.
    heap = [(load, rank) for rank, load in enumerate(start)]
    heapq.heapify(heap)
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, rank = heapq.heappop(heap)
        owners[index] = rank
        start[rank] = load + sizes[index]
        heapq.heappush(heap, (start[rank], rank))
    return owners, start


# ------------------------------------------------------------------ the exchange
def _pointers(params: list[torch.Tensor]) -> list[int]:
    return list(map(torch.Tensor.data_ptr, params))


@dataclass
class _Bucket:
    """The segments of one (device, dtype): for each rank owning some, a flat buffer."""

    dtype: torch.dtype
    segments: list[tuple[int, torch.Tensor]]  # (global source rank, contiguous slice)
    params: list[torch.Tensor]  # every parameter bound into the segments
    pointers: list[int]  # the data_ptr each must keep


class ParameterExchange:
    """Keeps parameters in rank-ordered flat buffers and broadcasts them after a step.

    Args:
        params_by_rank: for each group rank, the parameters it owns, in a global
            order that is the same on every rank.
        group: the process group (``None`` for the default group).
        global_ranks: the global rank of each group rank (broadcast sources).
    """

    def __init__(
        self,
        params_by_rank: Sequence[Sequence[torch.Tensor]],
        group: dist.ProcessGroup | None,
        global_ranks: Sequence[int],
    ) -> None:
        if len(params_by_rank) != len(global_ranks):
            raise ValueError("params_by_rank needs one entry per rank")
        self._params_by_rank = [list(ps) for ps in params_by_rank]
        self._group = group
        self._global_ranks = list(global_ranks)
        self._buckets: list[_Bucket] = []
        self._bind()

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    @property
    def broadcasts_per_step(self) -> int:
        """How many collectives one ``synchronize`` issues."""
        return sum(len(b.segments) for b in self._buckets)

    @torch.no_grad()
    def _bind(self) -> None:
        """Allocate the flat segments and point every parameter into them."""
        world = len(self._global_ranks)
        by_key: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
        # Keys appear in the first-owned order, which is identical on every rank.
        for rank, params in enumerate(self._params_by_rank):
            for p in params:
                by_key.setdefault((p.device, p.dtype), [[] for _ in range(world)])[rank].append(p)
        self._buckets = []
        for (device, dtype), per_rank in by_key.items():
            segments: list[tuple[int, torch.Tensor]] = []
            bound: list[torch.Tensor] = []
            for rank, params in enumerate(per_rank):
                total = sum(p.numel() for p in params)
                if total == 0:
                    continue  # ranks with nothing here are skipped by every rank alike
                segment = torch.empty(total, device=device, dtype=dtype)
                offset = 0
                for p in params:
                    view = segment[offset : offset + p.numel()].view(p.shape)
                    view.copy_(p.data)
                    p.data = view  # the old storage goes as soon as nothing else holds it
                    bound.append(p)
                    offset += p.numel()
                segments.append((self._global_ranks[rank], segment))
            self._buckets.append(_Bucket(dtype, segments, bound, _pointers(bound)))

    def ensure_bound(self) -> bool:
        """Rebuild the buffers if a parameter was rebound elsewhere; True if rebuilt.

        Only local work (an allocation and a copy); since the layout depends on the
        parameters alone, every rank rebuilds the same one. The check runs every step,
        so it is one comparison of pointer lists built in C (``map``), not a Python loop;
        a parameter converted to another dtype or device got new storage, so its pointer
        tells that too (the old segment is alive, so its address cannot be reused).
        """
        for bucket in self._buckets:
            if _pointers(bucket.params) != bucket.pointers:
                self._bind()
                return True
        return False

    @torch.no_grad()
    def synchronize(self) -> None:
        """Broadcast each rank's updated segment from its owner (collective)."""
        works = [
            dist.broadcast(segment, src=src, group=self._group, async_op=True)
            for bucket in self._buckets
            for src, segment in bucket.segments
        ]
        for work in works:
            work.wait()
