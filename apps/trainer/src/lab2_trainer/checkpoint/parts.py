"""What each rank holds of the model and of AdamW's state, and how it goes through
``torch.distributed.checkpoint`` (DCP) without ever being gathered.

**One layout for every kind.** A checkpoint holds, for each parameter (by its name in the
model, ``blocks.0.attn.qkv.weight``), the flattened 1-D view of the whole tensor:

* ``model.<name>``: the parameter;
* ``optim.<name>.exp_avg``, ``optim.<name>.exp_avg_sq``: AdamW's moments, of the
  parameter's size;
* ``optim.<name>.step``: AdamW's step count (one element);
* ``optim.<name>.momentum_buffer``: Muon's momentum (``--optimizer muon``: the blocks'
  matrices, each whole on its owner rank under zero1's kinds), of the parameter's size.

Every sharding kind holds each of these as contiguous ranges of that flat view, so every
rank describes what it holds as :class:`Part`\\ s, ``(key, start, local 1-D tensor)``:

* a replicated tensor (the model under none, zero1, zero2, zero1-allreduce and torch;
  AdamW's state under none) is whole on every rank: on save each rank writes an equal
  slice of it (the writes run in parallel, no rank writes everything); on load each rank
  reads it whole;
* zero1 and zero2's flat bucket shards cut across parameters: each piece a rank steps is
  a contiguous range of its parameter (:class:`zero1.flat.Piece`, ``start``);
* zero1-allreduce and torch (ZeroRedundancyOptimizer) give whole parameters' state to one
  rank each;
* fsdp's ``Shard(0)`` DTensors hold contiguous rows, a contiguous flat range;
* zero1's stage 3 (``zero1.shard_model`` and ``Stage3Optimizer``, "zero3") keeps each
  parameter's values and state in the same pieces of its units' flat shards.

A new kind adds its parts in :func:`model_parts` and :func:`state_holders`; nothing else
changes.

DCP is told about the parts by a small save planner (:class:`PartSavePlanner`: one
``WriteItem`` per part, with its offset in the whole tensor) and read back by a load
planner (:class:`PartLoadPlanner`) that asks DCP for exactly the ranges this rank holds;
DCP's resharding (``create_read_items_for_chunk_list``) finds them among whatever ranges
the saving ranks wrote. So a checkpoint loads at any world size and under any kind.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
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

from lab2_trainer.config import UsageError
from lab2_trainer.runtime.paths import open_regular

#: AdamW's per-parameter tensors of the parameter's size.
MOMENTS = ("exp_avg", "exp_avg_sq")
#: Muon's (zero1.Muon, torch.optim.Muon): one momentum buffer, and no step count.
MUON_STATE = ("momentum_buffer",)


def state_tensors(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """The per-parameter state tensors ``optimizer`` keeps: Muon's or AdamW's."""
    return MUON_STATE if type(optimizer).__name__ == "Muon" else MOMENTS


def model_key(name: str) -> str:
    return f"model.{name}"


def state_key(name: str, what: str) -> str:
    return f"optim.{name}.{what}"


@dataclass
class Part:
    """A contiguous range of one checkpoint tensor's flat view that this rank holds.

    Attributes:
        key: the checkpoint tensor (``model.<name>``, ``optim.<name>.exp_avg``, ...).
        numel: elements of the whole tensor.
        start: the first element of ``data`` in the whole tensor's flat view.
        data: this rank's range, 1-D (a view of the live tensor: loading writes there).
        replicated: every rank holds this same range (the whole tensor).
    """

    key: str
    numel: int
    start: int
    data: torch.Tensor
    replicated: bool = False

    def to_write(self, rank: int, world_size: int) -> Part | None:
        """What this rank writes of the part: all of it, or its equal slice of a
        replicated one (None when that slice is empty)."""
        if not self.replicated:
            return self if self.data.numel() else None
        lo, hi = self.numel * rank // world_size, self.numel * (rank + 1) // world_size
        if hi <= lo:
            return None
        return Part(self.key, self.numel, lo, self.data[lo:hi])


@dataclass
class StateHolder:
    """One range of a parameter whose AdamW state this rank keeps.

    Attributes:
        name: the parameter's name.
        numel: the parameter's elements.
        start: the range's first element in the parameter's flat view.
        tensor: what the optimizer keys the state by (the parameter, a DTensor, or a
            zero1 piece).
        optimizer: the optimizer that holds the state (a sharded one's local optimizer).
        replicated: every rank keeps the same whole state (plain AdamW under "none").
    """

    name: str
    numel: int
    start: int
    tensor: torch.Tensor
    optimizer: torch.optim.Optimizer
    replicated: bool = False

    @property
    def tensors(self) -> tuple[str, ...]:
        """The state's tensors of the parameter's size (AdamW's come with a ``step``)."""
        return state_tensors(self.optimizer)

    def flat(self, t: torch.Tensor) -> torch.Tensor:
        """A state tensor's local data, 1-D."""
        local = t.to_local() if hasattr(t, "to_local") else t
        return local.reshape(-1)

    @property
    def local_numel(self) -> int:
        return self.flat(self.tensor).numel()


# ------------------------------------------------------------------------ the layouts
def parameter_names(model: torch.nn.Module) -> dict[int, str]:
    """Each parameter's first name in the model (tied ones are saved once), by ``id``."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    return names


def _row_range(p: torch.Tensor, rank: int, world_size: int) -> tuple[int, int]:
    """The flat range of FSDP2's ``Shard(0)`` rows on ``rank``: ``torch.chunk``'s rule
    (ceil(rows / N) rows each, the last ranks short or empty)."""
    rows = p.shape[0]
    per = -(-rows // world_size)
    lo, hi = min(rows, rank * per), min(rows, (rank + 1) * per)
    row = math.prod(p.shape[1:])
    return lo * row, hi * row


def _rank_and_size() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def model_parts(model: torch.nn.Module, sharding: str,
                optimizer: torch.optim.Optimizer | None = None) -> list[Part]:
    """This rank's parts of the model's parameters (with "zero3", each parameter's piece
    of its unit's shard, whichever optimizer steps it; ``optimizer`` is not needed)."""
    rank, world = _rank_and_size()
    if sharding == "zero3":  # each parameter's piece of its unit's shard
        from zero1.stage3_optimizer import piece_of

        names = parameter_names(model)
        pieces = [piece_of(p) for p in model.parameters()]
        return [Part(model_key(names[id(piece.param)]), piece.param.numel(), piece.start,
                     piece.local.detach()) for piece in pieces if piece is not None]
    parts = []
    for name, p in model.named_parameters():
        if sharding == "fsdp":
            local = p.to_local().reshape(-1)
            lo, hi = _row_range(p, rank, world)
            if local.numel() != hi - lo:
                raise RuntimeError(f"{name}: FSDP2 holds {local.numel()} elements here, "
                                   f"{hi - lo} expected")
            parts.append(Part(model_key(name), p.numel(), lo, local.detach()))
        else:
            parts.append(Part(model_key(name), p.numel(), 0, p.detach().reshape(-1),
                              replicated=True))
    return parts


def state_holders(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  sharding: str) -> list[StateHolder]:
    """Where this rank keeps optimizer state, whatever the kind (with Muon, both
    optimizers')."""
    if hasattr(optimizer, "optimizers"):  # Muon with AdamW: each keeps its own
        return [h for opt in optimizer.optimizers for h in state_holders(model, opt, sharding)]
    names = parameter_names(model)
    rank, world = _rank_and_size()
    if sharding in ("zero1", "zero2", "zero1-allreduce", "zero3"):
        local = optimizer.local_optimizer
        return [StateHolder(names[id(piece.param)], piece.param.numel(), piece.start,
                            piece.local, local)
                for _, piece in optimizer.numbered_pieces()]
    if sharding == "torch":  # ZeroRedundancyOptimizer: whole parameters, its local AdamW
        mine = optimizer._partition_parameters()[rank]
        return [StateHolder(names[id(p)], p.numel(), 0, p, optimizer.optim)
                for group in mine for p in group["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if sharding == "fsdp":
        return [StateHolder(names[id(p)], p.numel(), _row_range(p, rank, world)[0], p,
                            optimizer) for p in params]
    return [StateHolder(names[id(p)], p.numel(), 0, p, optimizer, replicated=True)
            for p in params]


def state_parts(holders: list[StateHolder]) -> list[Part]:
    """The parts of the AdamW state this rank holds now (parameters not stepped yet have
    none). ``step`` is written by the holder of the parameter's first element (rank 0's
    copy when replicated)."""
    rank, _ = _rank_and_size()
    parts = []
    for h in holders:
        state = h.optimizer.state.get(h.tensor)
        if not state:
            continue
        for what in h.tensors:
            parts.append(Part(state_key(h.name, what), h.numel, h.start, h.flat(state[what]),
                              replicated=h.replicated))
        writes_step = rank == 0 if h.replicated else (h.start == 0 and h.local_numel > 0)
        if writes_step and "step" in state:
            step = state["step"]
            step = step if isinstance(step, torch.Tensor) else torch.tensor(float(step))
            parts.append(Part(state_key(h.name, "step"), 1, 0, step.detach().reshape(1)))
    return parts


# ------------------------------------------------------------------------ DCP planners
class PartSavePlanner(DefaultSavePlanner):
    """Writes each :class:`Part` as a chunk of its whole tensor's flat view."""

    def __init__(self, parts: list[Part]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.parts = {p.key: p for p in parts}
        if len(self.parts) != len(parts):
            raise ValueError("two parts of one tensor on one rank")

    def create_local_plan(self) -> SavePlan:
        items = []
        for p in self.parts.values():
            offsets = torch.Size([p.start])
            items.append(WriteItem(
                index=MetadataIndex(p.key, offsets), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=p.data.size()),
                    # The dtype only: a staged copy's pinned memory is not the tensor's.
                    properties=TensorProperties(dtype=p.data.dtype),
                    size=torch.Size([p.numel]))))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self.parts[index.fqn].data


class PartLoadPlanner(DefaultLoadPlanner):
    """Reads into each :class:`Part`'s ``data`` the range of the saved tensor it covers,
    from whichever chunks the saving ranks wrote."""

    def __init__(self, parts: list[Part]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.parts = {p.key: p for p in parts}

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        requests = []
        for p in self.parts.values():
            md = saved.get(p.key)
            if not isinstance(md, TensorStorageMetadata):
                raise ValueError(f"the checkpoint has no tensor {p.key}")
            if tuple(md.size) != (p.numel,):
                raise ValueError(f"tensor {p.key} has {math.prod(md.size)} elements in the "
                                 f"checkpoint, {p.numel} here")
            if p.data.numel():
                chunk = ChunkStorageMetadata(offsets=torch.Size([p.start]),
                                             sizes=p.data.size())
                requests += create_read_items_for_chunk_list(p.key, md, [chunk])
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.parts[index.fqn].data


def read_parts(parts: list[Part], reader: Any, process_group: Any = None) -> None:
    """Fill every part's ``data`` from a checkpoint (a collective over the group, or one
    process without ``torch.distributed``)."""
    import torch.distributed.checkpoint as dcp

    distributed = dist.is_available() and dist.is_initialized()
    with _alone_is_meant(distributed):
        _call(dcp.load, {p.key: p.data for p in parts}, distributed, storage_reader=reader,
              planner=PartLoadPlanner(parts), process_group=process_group)


def write_parts(parts: list[Part], writer: Any, process_group: Any = None) -> Any:
    """Write every part (a collective over the group); returns DCP's metadata."""
    import torch.distributed.checkpoint as dcp

    distributed = dist.is_available() and dist.is_initialized()
    with _alone_is_meant(distributed):
        return _call(dcp.save, {p.key: p.data for p in parts}, distributed,
                     storage_writer=writer, planner=PartSavePlanner(parts),
                     process_group=process_group)


def _call(fn: Any, state: dict[str, torch.Tensor], distributed: bool, **kwargs: Any) -> Any:
    """``dcp.save`` or ``dcp.load``, told when there is no process group (torch before 2.5
    takes no ``no_dist`` there and finds out by itself)."""
    if distributed:
        return fn(state, **kwargs)
    try:
        return fn(state, no_dist=True, **kwargs)
    except TypeError as exc:
        if "no_dist" not in str(exc):
            raise
        return fn(state, **kwargs)


@contextlib.contextmanager
def _alone_is_meant(distributed: bool) -> Iterator[None]:
    """Without torch.distributed one process is meant (a one-rank run, an export): DCP's
    warning that it assumes so is silenced."""
    if distributed:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield



def saved_tensors(folder: Path) -> dict[str, Any]:
    """DCP's metadata of a step folder: each tensor's name -> its storage metadata.

    Raises:
        UsageError: the metadata cannot be read.
    """
    return dict(dcp_metadata(folder).state_dict_metadata)


def dcp_metadata(folder: Path) -> Any:
    """DCP's ``Metadata`` of a step folder (its ``.metadata``, a regular file).

    Raises:
        UsageError: it cannot be read.
    """
    from torch.distributed.checkpoint import FileSystemReader

    try:
        with open_regular(Path(folder) / ".metadata"):  # never a FIFO's open
            pass
        return FileSystemReader(str(folder)).read_metadata()
    except Exception as exc:  # noqa: BLE001 (a damaged file can fail in any way)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"cannot read checkpoint {folder}/.metadata: {reason}") from None


# -------------------------------------------------------------------------- export
def full_tensors(folder: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The whole 1-D tensors ``names`` of a step folder (one process, no process group)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = saved_tensors(folder)
    parts = []
    for name in names:
        md = meta[name]
        parts.append(Part(name, int(md.size[0]), 0,
                          torch.empty(int(md.size[0]), dtype=md.properties.dtype)))
    read_parts(parts, FileSystemReader(str(folder)))
    return {p.key: p.data for p in parts}


def load_folder(folder: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                sharding: str) -> None:
    """Read this rank's part of the model and of AdamW's state from a step folder (every
    rank; collectives). The launcher checked the folder whole first (manifest, checksums,
    sizes, finite values).

    Raises:
        UsageError: it does not fit this model.
    """
    from torch.distributed.checkpoint import FileSystemReader


    try:
        load_into(model, optimizer, sharding, FileSystemReader(str(folder)),
                  set(saved_tensors(folder)))
    except ValueError as exc:
        raise UsageError(f"checkpoint {folder} does not fit: {exc}") from None


def load_into(model: torch.nn.Module, optimizer: torch.optim.Optimizer, sharding: str,
              reader: Any, saved_keys: set[str]) -> list[Part]:
    """Load a checkpoint's model and AdamW state into this rank's parameters and optimizer
    (every rank, a collective), whatever kind and world size wrote it. Returns the parts
    read (for the caller's finiteness check).

    Args:
        saved_keys: the tensors the checkpoint holds (its metadata's keys): a parameter
            without ``optim.<name>.exp_avg`` there was not stepped yet and gets no state.
    """
    parts = [Part(p.key, p.numel, p.start, p.data)
             for p in model_parts(model, sharding, optimizer)]
    holders = state_holders(model, optimizer, sharding)
    fresh: list[tuple[StateHolder, dict[str, torch.Tensor]]] = []
    for h in holders:
        if state_key(h.name, h.tensors[0]) not in saved_keys:
            continue
        state = {what: torch.zeros_like(h.tensor, memory_format=torch.contiguous_format)
                 for what in h.tensors}
        fresh.append((h, state))
        for what in h.tensors:
            parts.append(Part(state_key(h.name, what), h.numel, h.start, h.flat(state[what])))
        if h.tensors == MOMENTS:
            state["step"] = torch.zeros(1, dtype=torch.float32)
            parts.append(Part(state_key(h.name, "step"), 1, 0, state["step"]))
    with torch.no_grad():
        read_parts(parts, reader)
    install_state(fresh, optimizer)
    return parts


def install_state(fresh: list[tuple[StateHolder, dict[str, torch.Tensor]]],
                  optimizer: torch.optim.Optimizer) -> None:
    """Hand the loaded state to each local optimizer through its own ``load_state_dict``
    (which puts ``step`` where that optimizer keeps it: the CPU, or the device when fused)."""
    by_optimizer: dict[int, tuple[torch.optim.Optimizer, dict[int, Any]]] = {}
    for h, state in fresh:
        opt = h.optimizer
        numbers = {id(p): i for i, p in enumerate(
            p for g in opt.param_groups for p in g["params"])}
        entry = {what: state[what] for what in h.tensors}
        if "step" in state:
            entry["step"] = state["step"].reshape(())
        by_optimizer.setdefault(id(opt), (opt, {}))[1][numbers[id(h.tensor)]] = entry
    for opt, state in by_optimizer.values():
        groups = opt.state_dict()["param_groups"]
        opt.load_state_dict({"state": state, "param_groups": groups})
    for opt in getattr(optimizer, "optimizers", (optimizer,)):  # with Muon, two
        if hasattr(opt, "local_optimizer"):  # zero1's ShardedOptimizer aliases its state
            opt.state = opt.local_optimizer.state
