"""What each rank holds of the model and of the optimizer's state, and how it goes through
``torch.distributed.checkpoint`` (DCP) without ever being gathered.

**One layout for every kind.** A checkpoint holds, for each parameter (by its name in the
model, ``blocks.0.attn.qkv.weight``), the whole tensor in the shape it has at ``--tp 1``:

* ``model.<name>``: the parameter;
* ``optim.<name>.<state>``: each of the optimizer's per-parameter tensors of the
  parameter's shape (:data:`MOMENTS`: AdamW's ``exp_avg`` and ``exp_avg_sq``;
  :data:`MUON_STATE`: Muon's ``momentum_buffer``, with ``--optimizer muon`` for the
  blocks' matrices);
* ``optim.<name>.step``: each per-parameter count (:data:`COUNTS`: AdamW's; Muon keeps
  none), one element.

Which of these a parameter has is its optimizer's (:func:`state_names`): with Muon and
AdamW, each parameter has the names of the one that steps it.

A rank holds of each a *local* tensor (the whole one, or under tensor parallelism its
shard: :class:`~lab2_trainer.checkpoint.boxes.Cut`), and of that contiguous ranges of its
flat view, so every rank describes what it holds as :class:`Range`\\ s
``(key, local shape, start, local 1-D tensor, cut, copies)``:

* a replicated tensor (the model under none, zero1, zero2, zero1-allreduce and torch;
  the optimizer's state under none, Muon's as AdamW's) is whole on every data-parallel
  rank: on save each of the ranks holding it writes an equal slice of it (the writes run
  in parallel, no rank writes everything); on load each rank reads it whole;
* zero1 and zero2's flat bucket shards cut across parameters: each piece a rank steps is
  a contiguous range of its parameter (:class:`zero1.flat.Piece`, ``start``);
* zero1-allreduce and torch (ZeroRedundancyOptimizer) give whole parameters' state to one
  rank each;
* fsdp's ``Shard(0)`` DTensors hold contiguous rows, a contiguous flat range;
* zero1's stage 3 (``zero1.shard_model`` and ``Stage3Optimizer``, "zero3") keeps each
  parameter's values and state in the same pieces of its units' flat shards;
* Muon needs whole matrices: zero1, zero2 and zero3 step each of Muon's matrices whole
  on one owner rank (``zero1.whole_params``), which keeps its ``momentum_buffer`` whole,
  a range from 0, as zero1-allreduce and torch do (under zero3 the values stay in the
  units' pieces).

Under tensor parallelism (``--tp`` > 1, the ranks a dp x tp mesh) each kind acts over the
data-parallel ranks on the rank's shards; a parameter tensor parallelism leaves whole
(norms, positions) is held alike by the tensor-parallel ranks of a data-parallel index,
and they share its writing as replicas do (``copies``). A new kind adds its ranges in
:func:`model_parts` and :func:`state_holders`; nothing else changes.

A range is written and read as the boxes of the whole tensor it is
(:meth:`Range.parts`, :mod:`lab2_trainer.checkpoint.boxes`), each a :class:`Part`. DCP is
told about them by a small save planner
(:class:`~lab2_trainer.checkpoint.planners.PartSavePlanner`: one ``WriteItem`` per box) and
reads them back through a load planner
(:class:`~lab2_trainer.checkpoint.planners.PartLoadPlanner`) that asks for
exactly the boxes this rank holds; DCP's resharding (``create_read_items_for_chunk_list``)
finds them among whatever boxes the saving ranks wrote. So a checkpoint loads at any
world size, under any kind and at any ``--tp``. A checkpoint of manifest version 1
(every tensor stored as its 1-D flat view) loads too: each box is read from the ranges of
the flat view that hold it (:func:`~lab2_trainer.checkpoint.boxes.flat_ranges`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lab2_trainer.checkpoint.boxes import Cut
from lab2_trainer.config import UsageError
from lab2_trainer.runtime.paths import open_regular

#: The optimizer's per-parameter tensors of the parameter's shape (cut and sharded as the
#: parameter is), by their names in its state.
MOMENTS = ("exp_avg", "exp_avg_sq")
#: The optimizer's per-parameter counts: one element each, written by one rank.
COUNTS = ("step",)
#: Muon's (zero1.Muon, torch.optim.Muon) per-parameter tensors: one momentum buffer of the
#: parameter's shape, and no count.
MUON_STATE = ("momentum_buffer",)


def state_names(optimizer: torch.optim.Optimizer) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(tensors of the parameter's shape, counts) that ``optimizer`` keeps per parameter:
    Muon's (:data:`MUON_STATE`, none), else AdamW's (:data:`MOMENTS`, :data:`COUNTS`)."""
    return (MUON_STATE, ()) if type(optimizer).__name__ == "Muon" else (MOMENTS, COUNTS)


def model_key(name: str) -> str:
    return f"model.{name}"


def state_key(name: str, what: str) -> str:
    return f"optim.{name}.{what}"


@dataclass
class Part:
    """One box of one checkpoint tensor that this rank writes or reads.

    Attributes:
        key: the checkpoint tensor (``model.<name>``, ``optim.<name>.exp_avg``, ...).
        size: the whole tensor's shape.
        offsets: where the box starts in the whole tensor.
        data: the box, of its shape (a view of the live tensor: loading writes there).
    """

    key: str
    size: tuple[int, ...]
    offsets: tuple[int, ...]
    data: torch.Tensor


@dataclass
class Range:
    """A contiguous range of the flat view of this rank's local tensor of one checkpoint
    tensor.

    Attributes:
        key: the checkpoint tensor.
        shape: the local tensor's shape (the whole tensor's, cut by ``cut``).
        start: the first element of ``data`` in the local tensor's flat view.
        data: the range, 1-D (a view of the live tensor: loading writes there).
        cut: where the local tensor sits in the whole one.
        copies: (this rank's index, count) among the ranks that hold this same range;
            they share its writing.
    """

    key: str
    shape: tuple[int, ...]
    start: int
    data: torch.Tensor
    cut: Cut = Cut()
    copies: tuple[int, int] = (0, 1)

    @property
    def size(self) -> tuple[int, ...]:
        """The whole tensor's shape."""
        return self.cut.whole_shape(self.shape)

    def parts(self) -> list[Part]:
        """The boxes of the whole tensor that the range is, each a view of ``data``."""
        out = []
        stop = self.start + self.data.numel()
        for offsets, sizes, flat in self.cut.boxes(self.shape, self.start, stop):
            lo = flat - self.start
            out.append(Part(self.key, self.size, offsets,
                            self.data[lo:lo + math.prod(sizes)].view(sizes)))
        return out

    def to_write(self) -> Range | None:
        """What this rank writes of the range: all of it, or its equal slice when several
        ranks hold it (None when that is empty)."""
        index, count = self.copies
        n = self.data.numel()
        lo, hi = n * index // count, n * (index + 1) // count
        if hi <= lo:
            return None
        return dataclasses.replace(self, start=self.start + lo, data=self.data[lo:hi],
                                   copies=(0, 1))

    def writes_first(self) -> bool:
        """Whether this rank writes the whole tensor's first element (one rank does)."""
        mine = self.to_write()
        return mine is not None and mine.start == 0 and (mine.cut.whole or mine.cut.index == 0)


@dataclass(frozen=True)
class Placement:
    """Where this rank sits among the ranks, and which parameters tensor parallelism cuts.

    Attributes:
        dp_index, dp: this rank's data-parallel index, and the data-parallel ranks (what
            the sharding kinds act over).
        tp_index, tp: its tensor-parallel index, and the tensor-parallel ranks.
        cuts: parameter name -> (dim, parts) of each parameter cut
            (:attr:`lab2_trainer.parallel.tensor.TensorLayout.sharded`).
    """

    dp_index: int = 0
    dp: int = 1
    tp_index: int = 0
    tp: int = 1
    cuts: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def here(cls, layout: Any = None) -> Placement:
        """This rank's, from the default process group and the tensor-parallel ``layout``
        (:class:`~lab2_trainer.parallel.tensor.TensorLayout`; None: every rank
        data-parallel). The mesh is dp x tp, tensor-parallel ranks innermost."""
        rank, world = _rank_and_size()
        if layout is None or layout.tp == 1:
            return cls(rank, world)
        if rank % layout.tp != layout.rank:
            raise RuntimeError(f"rank {rank} is tensor-parallel rank {layout.rank} of "
                               f"{layout.tp}: the mesh is not dp x tp with tp innermost")
        return cls(rank // layout.tp, world // layout.tp, layout.rank, layout.tp,
                   dict(layout.sharded))

    def cut(self, name: str) -> Cut:
        """Where this rank's local tensor of parameter ``name`` sits in the whole one."""
        if name not in self.cuts:
            return Cut()
        dim, parts = self.cuts[name]
        return Cut(dim, parts, self.tp_index, self.tp)

    def copies(self, name: str, replicated: bool) -> tuple[int, int]:
        """(index, count) of this rank among those holding the same range of parameter
        ``name`` (or of its state): the data-parallel ranks when the kind replicates it
        there, times the tensor-parallel ranks when tensor parallelism leaves it whole."""
        index, count = (self.dp_index, self.dp) if replicated else (0, 1)
        if name not in self.cuts:
            index, count = index * self.tp + self.tp_index, count * self.tp
        return index, count

    def held(self, key: str, name: str, shape: torch.Size, start: int, data: torch.Tensor,
              replicated: bool = False) -> Range:
        """A :class:`Range` of parameter ``name``'s tensor ``key`` held here."""
        return Range(key, tuple(shape), start, data, self.cut(name),
                     self.copies(name, replicated))


@dataclass
class StateHolder:
    """One range of a parameter whose optimizer state this rank keeps.

    Attributes:
        name: the parameter's name.
        shape: the parameter's local shape (this rank's shard under tensor parallelism).
        start: the range's first element in the parameter's flat view.
        tensor: what the optimizer keys the state by (the parameter, a DTensor, or a
            zero1 piece).
        optimizer: the optimizer that holds the state (a sharded one's local optimizer).
        replicated: every data-parallel rank keeps the same whole state (a plain optimizer
            under "none").
    """

    name: str
    shape: torch.Size
    start: int
    tensor: torch.Tensor
    optimizer: torch.optim.Optimizer
    replicated: bool = False

    @property
    def tensors(self) -> tuple[str, ...]:
        """The state's tensors of the parameter's shape that its optimizer keeps."""
        return state_names(self.optimizer)[0]

    @property
    def counts(self) -> tuple[str, ...]:
        """The state's counts that its optimizer keeps (one element each)."""
        return state_names(self.optimizer)[1]

    def flat(self, t: torch.Tensor) -> torch.Tensor:
        """A state tensor's local data, 1-D."""
        local = t.to_local() if hasattr(t, "to_local") else t
        return local.reshape(-1)

    def held(self, what: str, t: torch.Tensor, at: Placement) -> Range:
        """The range of state tensor ``what`` (of the parameter's shape) held here."""
        return at.held(state_key(self.name, what), self.name, self.shape, self.start,
                        self.flat(t), self.replicated)


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
                optimizer: torch.optim.Optimizer | None = None,
                placement: Placement | None = None) -> list[Range]:
    """This rank's ranges of the model's parameters (with "zero3", each parameter's piece
    of its unit's shard, whichever optimizer steps it: ``optimizer`` is not needed;
    ``placement``: :meth:`Placement.here` by default)."""
    at = placement if placement is not None else Placement.here()
    names = parameter_names(model)
    if sharding == "zero3":  # Muon's pieces are whole matrices on their owners: not these
        from zero1.stage3_optimizer import piece_of

        out = []
        for piece in map(piece_of, model.parameters()):
            if piece is not None:
                name = names[id(piece.param)]
                out.append(at.held(model_key(name), name, piece.param.shape, piece.start,
                                    piece.local.detach().reshape(-1)))
        return out
    ranges = []
    for name, p in model.named_parameters():
        if sharding == "fsdp":
            local = p.to_local().reshape(-1)
            lo, hi = _row_range(p, at.dp_index, at.dp)
            if local.numel() != hi - lo:
                raise RuntimeError(f"{name}: FSDP2 holds {local.numel()} elements here, "
                                   f"{hi - lo} expected")
            ranges.append(at.held(model_key(name), name, p.shape, lo, local.detach()))
        else:
            ranges.append(at.held(model_key(name), name, p.shape, 0, p.detach().reshape(-1),
                                   replicated=True))
    return ranges


def state_holders(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  sharding: str, placement: Placement | None = None) -> list[StateHolder]:
    """Where this rank keeps optimizer state, whatever the kind (with Muon, both
    optimizers')."""
    at = placement if placement is not None else Placement.here()
    if hasattr(optimizer, "optimizers"):  # Muon with AdamW: each keeps its own
        return [h for opt in optimizer.optimizers
                for h in state_holders(model, opt, sharding, at)]
    names = parameter_names(model)
    if sharding in ("zero1", "zero2", "zero1-allreduce", "zero3"):
        local = optimizer.local_optimizer
        return [StateHolder(names[id(piece.param)], piece.param.shape, piece.start,
                            piece.local, local)
                for _, piece in optimizer.numbered_pieces()]
    if sharding == "torch":  # ZeroRedundancyOptimizer: whole parameters, its local AdamW
        mine = optimizer._partition_parameters()[at.dp_index]
        return [StateHolder(names[id(p)], p.shape, 0, p, optimizer.optim)
                for group in mine for p in group["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if sharding == "fsdp":
        return [StateHolder(names[id(p)], p.shape, _row_range(p, at.dp_index, at.dp)[0], p,
                            optimizer) for p in params]
    return [StateHolder(names[id(p)], p.shape, 0, p, optimizer, replicated=True)
            for p in params]


def state_parts(holders: list[StateHolder], placement: Placement | None = None) -> list[Range]:
    """The ranges of the optimizer state this rank holds now (parameters not stepped yet
    have none). A count (``step``) is written by the rank that writes its parameter's
    first element."""
    at = placement if placement is not None else Placement.here()
    ranges = []
    for h in holders:
        state = h.optimizer.state.get(h.tensor)
        if not state:
            continue
        moments = [h.held(what, state[what], at) for what in h.tensors if what in state]
        ranges += moments
        if moments and moments[0].writes_first():
            for what in h.counts:
                if what in state:
                    count = state[what]
                    if not isinstance(count, torch.Tensor):
                        count = torch.tensor(float(count))
                    ranges.append(Range(state_key(h.name, what), (1,), 0,
                                        count.detach().reshape(1)))
    return ranges


def write_share(ranges: list[Range]) -> list[Part]:
    """The boxes this rank writes of ``ranges`` (its share of each)."""
    return [part for r in ranges if (mine := r.to_write()) is not None
            for part in mine.parts()]


def read_parts(parts: list[Part], reader: Any, process_group: Any = None) -> None:
    """Fill every part's ``data`` from a checkpoint (a collective over the group, or one
    process without ``torch.distributed``)."""
    # Here, not at the top: a run's start-up needs no DCP before its first save or load.
    import torch.distributed.checkpoint as dcp

    from lab2_trainer.checkpoint.planners import PartLoadPlanner

    distributed = dist.is_available() and dist.is_initialized()
    with _alone_is_meant(distributed):
        _call(dcp.load, {p.key: p.data for p in parts}, distributed, storage_reader=reader,
              planner=PartLoadPlanner(parts), process_group=process_group)


def write_parts(parts: list[Part], writer: Any, process_group: Any = None) -> Any:
    """Write every part (a collective over the group); returns DCP's metadata."""
    # Here, not at the top: a run's start-up needs no DCP before its first save or load.
    import torch.distributed.checkpoint as dcp

    from lab2_trainer.checkpoint.planners import PartSavePlanner

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
    """The whole tensors ``names`` of a step folder, as stored (each in its shape; flat
    in a checkpoint of manifest version 1), read by one process, no process group."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = saved_tensors(folder)
    parts = []
    for name in names:
        size = tuple(int(n) for n in meta[name].size)
        parts.append(Part(name, size, (0,) * len(size),
                          torch.empty(size, dtype=meta[name].properties.dtype)))
    read_parts(parts, FileSystemReader(str(folder)))
    return {p.key: p.data for p in parts}


def load_folder(folder: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                sharding: str, layout: Any = None) -> None:
    """Read this rank's part of the model and of the optimizer's state from a step folder
    (every rank; collectives; ``layout``: the tensor-parallel cut, or None). The launcher
    checked the folder whole first (manifest, checksums, sizes, finite values).

    Raises:
        UsageError: it does not fit this model.
    """
    from torch.distributed.checkpoint import FileSystemReader

    try:
        load_into(model, optimizer, sharding, FileSystemReader(str(folder)),
                  set(saved_tensors(folder)), Placement.here(layout))
    except ValueError as exc:
        raise UsageError(f"checkpoint {folder} does not fit: {exc}") from None


def load_into(model: torch.nn.Module, optimizer: torch.optim.Optimizer, sharding: str,
              reader: Any, saved_keys: set[str],
              placement: Placement | None = None) -> list[Range]:
    """Load a checkpoint's model and optimizer state into this rank's parameters and
    optimizer (every rank, a collective), whatever kind, world size and ``--tp`` wrote it.
    Returns the ranges read.

    Args:
        saved_keys: the tensors the checkpoint holds (its metadata's keys): a parameter
            without any ``optim.<name>.<state>`` there was not stepped yet and gets no
            state.
    """
    ranges, fresh = _targets(model, optimizer, sharding, saved_keys.__contains__, placement)
    with torch.no_grad():
        read_parts([part for r in ranges for part in r.parts()], reader)
    install_state(fresh, optimizer)
    return ranges


def load_whole(model: torch.nn.Module, optimizer: torch.optim.Optimizer, sharding: str,
               tensors: Mapping[str, torch.Tensor], placement: Placement | None = None,
               only_state: bool = False) -> None:
    """Load this rank's part of whole tensors in memory (keyed as in a checkpoint, each in
    its whole shape, on every rank: a single-file checkpoint's), as :func:`load_into`
    reads a step folder's; ``only_state``: the optimizer's state alone."""
    ranges, fresh = _targets(model, optimizer, sharding, tensors.__contains__, placement)
    with torch.no_grad():
        for r in ranges:
            if only_state and r.key.startswith("model."):
                continue
            whole = tensors[r.key]
            for p in r.parts():
                box = tuple(slice(o, o + n) for o, n in zip(p.offsets, p.data.shape))
                p.data.copy_(whole.reshape(p.size)[box])
    install_state(fresh, optimizer)


def _targets(model: torch.nn.Module, optimizer: torch.optim.Optimizer, sharding: str,
             saved: Callable[[str], bool], placement: Placement | None
             ) -> tuple[list[Range], list[tuple[StateHolder, dict[str, torch.Tensor]]]]:
    """The ranges this rank loads (views of its parameters, and of fresh optimizer state
    for every parameter with state saved), and that state, to install once read."""
    at = placement if placement is not None else Placement.here()
    ranges = model_parts(model, sharding, optimizer, at)
    fresh: list[tuple[StateHolder, dict[str, torch.Tensor]]] = []
    for h in state_holders(model, optimizer, sharding, at):
        moments = [m for m in h.tensors if saved(state_key(h.name, m))]
        counts = [c for c in h.counts if saved(state_key(h.name, c))]
        if not moments and not counts:
            continue
        state = {m: torch.zeros_like(h.tensor, memory_format=torch.contiguous_format)
                 for m in moments}
        state.update({c: torch.zeros(1, dtype=torch.float32) for c in counts})
        fresh.append((h, state))
        ranges += [h.held(m, state[m], at) for m in moments]
        ranges += [Range(state_key(h.name, c), (1,), 0, state[c]) for c in counts]
    return ranges, fresh


def install_state(fresh: list[tuple[StateHolder, dict[str, torch.Tensor]]],
                  optimizer: torch.optim.Optimizer) -> None:
    """Hand the loaded state to each local optimizer through its own ``load_state_dict``
    (which puts ``step`` where that optimizer keeps it: the CPU, or the device when fused)."""
    by_optimizer: dict[int, tuple[torch.optim.Optimizer, dict[int, Any]]] = {}
    for h, state in fresh:
        opt = h.optimizer
        numbers = {id(p): i for i, p in enumerate(
            p for g in opt.param_groups for p in g["params"])}
        entry = {what: t.reshape(()) if what in COUNTS else t for what, t in state.items()}
        by_optimizer.setdefault(id(opt), (opt, {}))[1][numbers[id(h.tensor)]] = entry
    for opt, state in by_optimizer.values():
        groups = opt.state_dict()["param_groups"]
        opt.load_state_dict({"state": state, "param_groups": groups})
    for opt in getattr(optimizer, "optimizers", (optimizer,)):  # with Muon, two
        if hasattr(opt, "local_optimizer"):  # zero1's ShardedOptimizer aliases its state
            opt.state = opt.local_optimizer.state
