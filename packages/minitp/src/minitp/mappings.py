"""The conjugate collectives of tensor and sequence parallelism, as autograd Functions.

A tensor-parallel layer computes on a shard. Where a tensor passes from "the same on every
rank of the group" to "one part per rank", or back, the ranks must talk, and what forward
does there fixes what backward must do: backward runs the adjoint of forward's map. Each
function below is one such pair, on a given process group:

==============================  ======================  ======================
function                        forward                 backward
==============================  ======================  ======================
``copy_to_region``              identity                all-reduce
``reduce_from_region``          all-reduce              identity
``split_to_region``             keep this rank's slice  all-gather
``gather_from_region``          all-gather              keep this rank's slice
``split_to_sequence``           keep this rank's slice  all-gather
``gather_from_sequence``        all-gather              reduce-scatter
``reduce_scatter_to_sequence``  reduce-scatter          all-gather
==============================  ======================  ======================

Why: a tensor copied to every rank feeds a different shard of the computation on each, so
its gradient is the sum of the ranks' gradients (copy's adjoint is an all-reduce); a sum
over ranks hands every rank the same gradient (all-reduce's adjoint is the identity).
``gather_from_region`` and ``gather_from_sequence`` differ only in backward, because what
follows them differs: after a column layer's gathered output every rank computes the same
thing, so each already holds the whole gradient and keeps its slice; after gathering a
column layer's *input* along the sequence, each rank multiplies by its own weight shard,
so the gradients are partial sums that must be summed and cut: a reduce-scatter.

"Region" functions act on the feature dimension (the last, by default), "sequence"
functions on the sequence dimension (1 of ``[B, T, d]`` by default; ``[T, B, d]`` with
``dim=0`` needs no transposes). Every ``dim`` is explicit. A group of one rank
communicates nothing: every function returns its input.

Counting. :func:`count_communication` records each *logical* collective issued here (kind,
forward or backward, the full tensor's bytes), whichever implementation ran: a public
debugging aid, and what the tests match to the volume formula.

Fallbacks. Gloo lacks ``reduce_scatter_tensor`` (and in some builds
``all_gather_into_tensor``) in some torch versions. When a backend says so, the
reduce-scatter becomes an all-reduce of the whole tensor followed by keeping this rank's
slice (twice the traffic: a ring all-reduce sends 2(n-1)/n of the tensor per rank, a
reduce-scatter (n-1)/n), and the all-gather becomes ``all_gather`` into a list then one
copy (the same traffic). The counter still records a reduce-scatter or an all-gather.
:func:`fallback_collectives` forces them, so that they can be tested anywhere.

Compilation. ``torch.compile`` cannot trace ``torch.distributed``'s in-place collectives
started with ``async_op=True`` (dynamo breaks the graph at each). While it traces
(``torch.compiler.is_compiling()``), every collective here is a functional collective
instead, the ops under ``torch.distributed._functional_collectives``
(``_c10d_functional.all_reduce``, ``all_gather_into_tensor`` and ``reduce_scatter_tensor``
along dim 0, and ``wait_tensor`` where eager waits for its work), so that a region of
tensor-parallel layers is one graph forward and backward. The ops rather than that
module's functions: while tracing, those put the wait right after the collective, which
would take the column layer's overlap out of the graph; with the ops the wait stands after
the weight gradient's product, as in eager. Functional collectives allocate their result
rather than writing into their input, so callers use what :meth:`Pending.wait` returns. In
eager mode nothing changes: the ``torch.distributed`` calls. Under compilation the
fallbacks are used where forced or where an eager call has already found the collective
missing (a compiled graph cannot try and catch), and nothing is counted:
:func:`count_communication` sees eager calls only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives  # noqa: F401 (the ops' tracing rules)
from torch.autograd import Function

Group = dist.ProcessGroup | None


def compiling() -> bool:
    """Whether ``torch.compile`` is tracing the caller (then the collectives here are
    functional ones)."""
    return torch.compiler.is_compiling()


# ------------------------------------------------------------------ process group
def group_size(group: Group) -> int:
    """Number of ranks in ``group`` (the default group when None)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("minitp needs an initialized process group: call "
                           "torch.distributed.init_process_group(...) first")
    return dist.get_world_size(group=group)


def group_rank(group: Group) -> int:
    """This process's rank inside ``group``."""
    group_size(group)
    return dist.get_rank(group=group)


def _split_size(size: int, n: int, dim: int, what: str) -> int:
    if size % n:
        raise ValueError(f"{what}: size {size} along dim {dim} is not divisible by the "
                         f"group's {n} ranks")
    return size // n


# ------------------------------------------------------------------ counting
#: Bytes each rank sends, as a multiple of the full tensor's bytes times (n-1)/n, in the
#: ring algorithms: an all-reduce is a reduce-scatter then an all-gather.
_RING_FACTOR = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}


@dataclass(frozen=True)
class CommRecord:
    """One logical collective.

    Attributes:
        kind: ``"all_reduce"``, ``"all_gather"`` or ``"reduce_scatter"``.
        phase: ``"forward"`` or ``"backward"``.
        shape: the full tensor's shape (an all-gather's output, a reduce-scatter's input).
        nbytes: the full tensor's bytes.
        world_size: ranks in the group.
    """

    kind: str
    phase: str
    shape: tuple[int, ...]
    nbytes: int
    world_size: int

    @property
    def ring_bytes(self) -> float:
        """Bytes each rank sends (and receives) when the collective runs as a ring."""
        n = self.world_size
        return _RING_FACTOR[self.kind] * (n - 1) / n * self.nbytes


@dataclass
class CommCounter:
    """What :func:`count_communication` saw: ``records`` in issue order."""

    records: list[CommRecord] = field(default_factory=list)

    def select(self, kind: str | None = None, phase: str | None = None,
               shape: tuple[int, ...] | None = None) -> list[CommRecord]:
        """The records of one kind, phase and/or full shape (None: any)."""
        return [r for r in self.records if (kind is None or r.kind == kind)
                and (phase is None or r.phase == phase)
                and (shape is None or r.shape == tuple(shape))]

    def total_bytes(self, kind: str | None = None, phase: str | None = None) -> int:
        """Sum of the full tensors' bytes of the records selected."""
        return sum(r.nbytes for r in self.select(kind, phase))

    def ring_bytes(self, kind: str | None = None, phase: str | None = None) -> float:
        """Bytes each rank sends in ring collectives, over the records selected."""
        return sum(r.ring_bytes for r in self.select(kind, phase))


_COUNTERS: list[CommCounter] = []


@contextlib.contextmanager
def count_communication() -> Iterator[CommCounter]:
    """Record every collective minitp issues in this process while the block runs.

    ``with count_communication() as c: loss.backward()``, then ``c.records``. Counters
    nest; each sees everything issued while it is open.
    """
    counter = CommCounter()
    _COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _COUNTERS.remove(counter)


def _record(kind: str, phase: str, full: torch.Tensor | torch.Size, itemsize: int,
            n: int) -> None:
    if compiling():  # a compiled graph runs what was traced: nothing to count here
        return
    if _COUNTERS:
        shape = tuple(full)
        numel = 1
        for s in shape:
            numel *= s
        rec = CommRecord(kind, phase, shape, numel * itemsize, n)
        for counter in _COUNTERS:
            counter.records.append(rec)


# ------------------------------------------------------------------ the collectives
# Each starts one collective asynchronously and returns a Pending whose wait() gives the
# result: the column layer's backward overlaps its input-gradient reduction with the
# weight-gradient matmul that way; everything else waits at once.
class Pending:
    """A collective in flight; :meth:`wait` finishes it and returns its result."""

    def __init__(self, work: dist.Work | None, result: Callable[[], torch.Tensor]) -> None:
        self._work, self._result = work, result

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._result()


def _functional():
    """The functional collectives' ops (``torch.ops._c10d_functional``)."""
    return torch.ops._c10d_functional


def _traced(started: torch.Tensor, finish: Callable[[torch.Tensor], torch.Tensor]) -> Pending:
    """A functional collective in flight: ``wait_tensor`` marks where the graph needs its
    result (what eager's ``work.wait()`` does), then ``finish`` shapes it."""
    return Pending(None, lambda: finish(_functional().wait_tensor(started)))


def _group_name(group: Group) -> str:
    """The name the functional collectives know a group by (the default group's for
    None)."""
    return (dist.group.WORLD if group is None else group).group_name


#: The functional collectives' names of the reductions minitp uses.
_OP_NAMES = (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX),
             ("min", dist.ReduceOp.MIN))


def _op_name(op: dist.ReduceOp) -> str:
    for name, value in _OP_NAMES:
        if op == value:
            return name
    raise ValueError(f"minitp reduces by sum, max or min only, got {op}")


#: (collective, backend) pairs a backend has said it lacks; the fallback is used from then on.
_MISSING: set[tuple[str, str]] = set()
_FORCE_FALLBACK = [False]


@contextlib.contextmanager
def fallback_collectives() -> Iterator[None]:
    """Use the fallbacks (all-reduce then slice; ``all_gather`` into a list, or under
    compilation an all-reduce of zeros around this rank's part) while the block runs, even
    where the backend has the tensor collectives: to test them."""
    saved = _FORCE_FALLBACK[0]
    _FORCE_FALLBACK[0] = True
    try:
        yield
    finally:
        _FORCE_FALLBACK[0] = saved


def _native(name: str, group: Group, launch: Callable[[], dist.Work]) -> dist.Work | None:
    """``launch()``'s work, or None when the backend lacks collective ``name`` (then the
    caller runs its fallback). A backend that lacks one raises on every rank alike before
    sending anything, so every rank takes the same path."""
    backend = str(dist.get_backend(group))
    if _FORCE_FALLBACK[0] or (name, backend) in _MISSING:
        return None
    try:
        return launch()
    except (RuntimeError, NotImplementedError) as exc:
        text = str(exc).lower()
        if "support" not in text and "not implemented" not in text:
            raise
        _MISSING.add((name, backend))
        return None


def _traced_fallback(name: str) -> bool:
    """Under compilation: whether to trace the fallback of collective ``name`` (forced, or
    found missing by an eager call on some backend)."""
    return _FORCE_FALLBACK[0] or any(missing == name for missing, _ in _MISSING)


def start_all_reduce(x: torch.Tensor, group: Group, phase: str,
                     op: dist.ReduceOp = dist.ReduceOp.SUM) -> Pending:
    """Sum (or ``op``) ``x`` over the group; ``wait()`` returns the result. In eager mode
    the sum is written into ``x`` (contiguous, the caller's to overwrite) and ``wait()``
    returns ``x``; under compilation ``x`` is left alone and the result is a new tensor."""
    n = group_size(group)
    _record("all_reduce", phase, x.shape, x.element_size(), n)
    if compiling():
        return _traced(_functional().all_reduce(x, _op_name(op), _group_name(group)),
                       lambda out: out)
    return Pending(dist.all_reduce(x, op=op, group=group, async_op=True), lambda: x)


def start_all_gather(x: torch.Tensor, dim: int, group: Group, phase: str) -> Pending:
    """Concatenate every rank's ``x`` along ``dim``, in rank order."""
    n = group_size(group)
    dim = dim % x.dim()
    moved = x.movedim(dim, 0).contiguous()  # the collectives concatenate along dim 0
    full = torch.Size((n * moved.shape[0], *moved.shape[1:]))
    _record("all_gather", phase, x.shape[:dim] + (full[0],) + x.shape[dim + 1:],
            x.element_size(), n)
    if compiling():
        name = _group_name(group)
        if _traced_fallback("all_gather_into_tensor"):
            # Zeros but for this rank's part, summed: every rank's parts, twice the traffic.
            r = group_rank(group)
            zeros = [moved.new_zeros(moved.shape)] * n
            placed = torch.cat([*zeros[:r], moved, *zeros[r + 1:]])
            return _traced(_functional().all_reduce(placed, "sum", name),
                           lambda out: out.movedim(0, dim).contiguous())
        return _traced(_functional().all_gather_into_tensor(moved, n, name),
                       lambda out: out.movedim(0, dim).contiguous())
    out = moved.new_empty(full)
    work = _native("all_gather_into_tensor", group, lambda: dist.all_gather_into_tensor(
        out, moved, group=group, async_op=True))
    if work is not None:
        return Pending(work, lambda: out.movedim(0, dim).contiguous())
    parts = list(out.chunk(n))
    work = dist.all_gather(parts, moved, group=group, async_op=True)

    def finish() -> torch.Tensor:
        # all_gather may have written into buffers of its own rather than our views.
        for part, got in zip(out.chunk(n), parts):
            if got.data_ptr() != part.data_ptr():
                part.copy_(got)
        return out.movedim(0, dim).contiguous()

    return Pending(work, finish)


def start_reduce_scatter(x: torch.Tensor, dim: int, group: Group, phase: str) -> Pending:
    """Sum ``x`` over the group and keep this rank's slice along ``dim``."""
    n = group_size(group)
    dim = dim % x.dim()
    _split_size(x.shape[dim], n, dim, "reduce-scatter")
    _record("reduce_scatter", phase, x.shape, x.element_size(), n)
    moved = x.movedim(dim, 0).contiguous()
    if compiling():
        name = _group_name(group)
        if _traced_fallback("reduce_scatter_tensor"):
            r = group_rank(group)
            return _traced(_functional().all_reduce(moved, "sum", name),
                           lambda out: out.chunk(n)[r].movedim(0, dim).contiguous())
        return _traced(_functional().reduce_scatter_tensor(moved, "sum", n, name),
                       lambda out: out.movedim(0, dim).contiguous())
    out = moved.new_empty((moved.shape[0] // n, *moved.shape[1:]))
    work = _native("reduce_scatter_tensor", group, lambda: dist.reduce_scatter_tensor(
        out, moved, group=group, async_op=True))
    if work is not None:
        return Pending(work, lambda: out.movedim(0, dim).contiguous())
    rank = group_rank(group)
    buf = _own(moved)  # the all-reduce works in place: never on the caller's tensor
    work = dist.all_reduce(buf, group=group, async_op=True)
    return Pending(work, lambda: buf.chunk(n)[rank].movedim(0, dim).contiguous())


def _slice(x: torch.Tensor, dim: int, group: Group, what: str) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim``, in storage of its own."""
    n = group_size(group)
    _split_size(x.shape[dim], n, dim % x.dim(), what)
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


def _own(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy that an in-place collective may overwrite (under compilation ``x``
    itself: the functional collectives write nothing in place)."""
    if compiling():
        return x
    return x.clone(memory_format=torch.contiguous_format)


# ------------------------------------------------------------------ the pairs
class _CopyToRegion(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return start_all_reduce(_own(grad), ctx.group, "backward").wait(), None


class _ReduceFromRegion(Function):
    @staticmethod
    def forward(ctx, x, group):
        return start_all_reduce(_own(x), group, "forward").wait()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Split(Function):
    """Keep this rank's slice; backward all-gathers the gradient (region or sequence)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _slice(x, dim, group, "split")

    @staticmethod
    def backward(ctx, grad):
        return start_all_gather(grad, ctx.dim, ctx.group, "backward").wait(), None, None


class _GatherFromRegion(Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return start_all_gather(x, dim, group, "forward").wait()

    @staticmethod
    def backward(ctx, grad):
        return _slice(grad, ctx.dim, ctx.group, "gradient of gather_from_region"), None, None


class _GatherFromSequence(Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return start_all_gather(x, dim, group, "forward").wait()

    @staticmethod
    def backward(ctx, grad):
        return start_reduce_scatter(grad, ctx.dim, ctx.group, "backward").wait(), None, None


class _ReduceScatterToSequence(Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return start_reduce_scatter(x, dim, group, "forward").wait()

    @staticmethod
    def backward(ctx, grad):
        return start_all_gather(grad, ctx.dim, ctx.group, "backward").wait(), None, None


# ------------------------------------------------------------------ public functions
def copy_to_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Enter the parallel region: identity forward, all-reduce of the gradient backward."""
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Leave it by summing the ranks' partial results: all-reduce forward, identity
    backward."""
    return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group)


def split_to_region(x: torch.Tensor, group: Group = None, dim: int = -1) -> torch.Tensor:
    """Keep this rank's slice along ``dim`` (features); backward all-gathers."""
    return x if group_size(group) == 1 else _Split.apply(x, group, dim)


def gather_from_region(x: torch.Tensor, group: Group = None, dim: int = -1) -> torch.Tensor:
    """All-gather along ``dim`` (features); backward keeps this rank's slice."""
    return x if group_size(group) == 1 else _GatherFromRegion.apply(x, group, dim)


def split_to_sequence(x: torch.Tensor, group: Group = None, dim: int = 1) -> torch.Tensor:
    """Keep this rank's slice of the sequence; backward all-gathers."""
    return x if group_size(group) == 1 else _Split.apply(x, group, dim)


def gather_from_sequence(x: torch.Tensor, group: Group = None, dim: int = 1) -> torch.Tensor:
    """All-gather the sequence slices; backward reduce-scatters (the ranks' gradients are
    partial sums)."""
    return x if group_size(group) == 1 else _GatherFromSequence.apply(x, group, dim)


def reduce_scatter_to_sequence(x: torch.Tensor, group: Group = None,
                               dim: int = 1) -> torch.Tensor:
    """Sum the ranks' partial results and keep this rank's slice of the sequence;
    backward all-gathers."""
    return x if group_size(group) == 1 else _ReduceScatterToSequence.apply(x, group, dim)


def sum_gradient_over_group(param: torch.Tensor, group: Group = None) -> object:
    """Make ``param``'s gradient the sum of every rank's: for a parameter held whole on
    every rank but used on this rank's slice of the sequence (a norm's weight, a row
    layer's bias under sequence parallelism), each rank's gradient covers only its slice.

    A hook all-reduces each gradient before it is accumulated into ``.grad`` (so gradient
    accumulation stays right). Returns the hook's handle; a group of one registers none.
    """
    if group_size(group) == 1:
        return None

    def hook(grad: torch.Tensor) -> torch.Tensor:
        return start_all_reduce(_own(grad), group, "backward").wait()

    return param.register_hook(hook)
