"""The two small ``torch.distributed.checkpoint`` (DCP) planners through which a rank writes
and reads exactly the boxes it holds (:class:`~lab2_trainer.checkpoint.parts.Part`\\ s).

:class:`PartSavePlanner` makes one ``WriteItem`` per box; :class:`PartLoadPlanner` asks for
exactly the boxes this rank holds, and DCP's resharding (``create_read_items_for_chunk_list``)
finds them among whatever boxes the saving ranks wrote; from a checkpoint of manifest
version 1 (every tensor stored as its 1-D flat view) each box is read from the ranges of the
flat view that hold it (:func:`~lab2_trainer.checkpoint.boxes.flat_ranges`).

A module of their own, imported only when a checkpoint is written or read
(:func:`~lab2_trainer.checkpoint.parts.read_parts`,
:func:`~lab2_trainer.checkpoint.parts.write_parts`), so that a run's start-up does not
import DCP.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from lab2_trainer.checkpoint.boxes import flat_ranges


class Box(Protocol):
    """What the planners read of a :class:`~lab2_trainer.checkpoint.parts.Part`: the checkpoint
    tensor's key, the whole tensor's shape, where the box starts in it, and the box."""

    key: str
    size: tuple[int, ...]
    offsets: tuple[int, ...]
    data: torch.Tensor


def _where(key: str, offsets: Any) -> tuple[str, tuple[int, ...]]:
    return key, tuple(int(o) for o in offsets)


class PartSavePlanner(DefaultSavePlanner):
    """Writes each part (a :class:`Box`) as a box of its whole tensor."""

    def __init__(self, parts: Sequence[Box]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.parts = {_where(p.key, p.offsets): p for p in parts}
        if len(self.parts) != len(parts):
            raise ValueError("two parts of one tensor at one place on one rank")

    def create_local_plan(self) -> SavePlan:
        items = []
        for p in self.parts.values():
            offsets = torch.Size(p.offsets)
            items.append(WriteItem(
                index=MetadataIndex(p.key, offsets), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=p.data.size()),
                    # The dtype only: a staged copy's pinned memory is not the tensor's.
                    properties=TensorProperties(dtype=p.data.dtype),
                    size=torch.Size(p.size))))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self.parts[_where(index.fqn, index.offset)].data


class PartLoadPlanner(DefaultLoadPlanner):
    """Reads into each part's ``data`` the box of the saved tensor it covers, from whichever
    boxes the saving ranks wrote; from a checkpoint of manifest version 1 (each tensor stored
    as its flat view), from the ranges of that view that hold it."""

    def __init__(self, parts: Sequence[Box]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.parts = parts
        self.targets: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        requests = []
        for p in self.parts:
            md = saved.get(p.key)
            if not isinstance(md, TensorStorageMetadata):
                raise ValueError(f"the checkpoint has no tensor {p.key}")
            stored = tuple(md.size)
            if stored == p.size:
                wanted = [(p.offsets, p.data)]
            elif stored == (math.prod(p.size),):  # manifest version 1: the flat view
                flat = p.data.view(-1)
                wanted = [((start,), flat[at:at + n])
                          for start, n, at in flat_ranges(p.size, p.offsets, p.data.shape)]
            else:
                raise ValueError(f"tensor {p.key} is {list(stored)} in the checkpoint, "
                                 f"{list(p.size)} here")
            for offsets, data in wanted:
                if not data.numel():
                    continue
                self.targets[_where(p.key, offsets)] = data
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=data.size())
                requests += create_read_items_for_chunk_list(p.key, md, [chunk])
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.targets[_where(index.fqn, index.offset)]
