"""ZeRO stage 3: the parameters sharded too, gathered unit by unit while they are used.

A *unit* is a module (say a Transformer block). :func:`shard_model` lays each unit's
parameters out in one flat buffer, padded to a multiple of the world size N, and keeps on
each rank only its equal 1/N: the *shard* (``C = padded / N`` elements, in the
parameters' own dtype), which is what the optimizer steps. The unit's full buffer
(``padded`` elements, in ``param_dtype``) exists only while the unit is in use: its
storage is resized to zero otherwise. The model's ``Parameter`` objects stay where they
were (names, tying and param groups keep working); each is a view of its unit's full
buffer, so between uses it keeps its shape but has no storage.

One training step, on every rank:

1. Forward: before a unit runs (a forward pre-hook), its shard is all-gathered into the
   full buffer, or the gather already prefetched is waited for; then the next unit's
   gather starts asynchronously (the order is the one the units first ran in). After
   the unit runs (a forward hook) the full buffer is freed (``reshard_after_forward``),
   or kept until the unit's backward. The root unit (the model itself, holding what no
   other unit does) is kept: the backward starts with it.
2. Backward: a hook on the unit's outputs fires before its backward; the unit is gathered
   again if it was freed, and the previous unit's gather is prefetched. A recomputing
   forward (activation checkpointing) inside the backward gathers as well and frees
   nothing. When every trainable parameter of the unit has its gradient and the
   gradients of the unit's inputs are computed (an autograd function on the inputs),
   the gradients are packed into one flat buffer in ``reduce_dtype``, the parameters'
   ``.grad`` are dropped, an asynchronous reduce-scatter leaves this rank the sum of its
   shard, and the full buffer is freed. An autograd-engine callback at the end of the
   backward reduces what is left (units whose parameters got no gradient here) and frees
   every buffer still gathered.
3. The optimizer (:class:`zero1.stage3_optimizer.Stage3Optimizer`) waits for the
   reductions, steps the shards, and nothing else: the next forward gathers.

Sent per rank and step: a gather in the forward, one in the backward (not for the root
unit, nor any unit with ``reshard_after_forward=False``) and a reduce-scatter, each of
the unit's padded size: 3Ψ, or 2Ψ without resharding (Ψ parameter elements).

Every rank must run the same units in the same order (the collectives pair up by order).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .flat import FlatLayout, ShardCollectives

FREE, GATHERING, FULL = "free", "gathering", "full"


def _eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Keep ``fn`` out of ``torch.compile``'s graphs: a compiled model breaks its graph at
    the hook and runs it as Python (gathers and frees outside the compiled regions)."""
    dynamo = getattr(torch, "_dynamo", None)
    return dynamo.disable(fn) if dynamo is not None and hasattr(dynamo, "disable") else fn


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a recomputing
    forward of activation checkpointing runs inside it)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _gradient_hook(owner: weakref.ref[ShardedModel], unit: int, index: int
                   ) -> Callable[[torch.Tensor], None]:
    """The hook of parameter ``index`` of unit number ``unit``: it tells the sharded model,
    while there is one, that the parameter's gradient is ready."""

    def hook(_param: torch.Tensor) -> None:
        sharded = owner()
        if sharded is not None:
            sharded._grad_ready(sharded.units[unit], index)

    return hook


def _replace(value: Any, swap: dict[int, torch.Tensor]) -> Any:
    """``value`` with each tensor whose id is in ``swap`` replaced, through lists, tuples
    and dicts. (A module-level function: a nested one that calls itself is a reference
    cycle, which would keep ``swap``'s tensors, and the graph behind them, until a
    garbage collection.)"""
    if isinstance(value, torch.Tensor):
        return swap.get(id(value), value)
    if isinstance(value, tuple):
        return tuple(_replace(v, swap) for v in value)
    if isinstance(value, list):
        return [_replace(v, swap) for v in value]
    if isinstance(value, dict):
        return {k: _replace(v, swap) for k, v in value.items()}
    return value


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward tells the unit that the gradients of its
    inputs are computed: its backward is over, its full parameters are no longer read."""

    @staticmethod
    def forward(ctx: Any, unit: Unit, *inputs: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.unit = unit
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        ctx.unit.inputs_done += 1
        ctx.unit.owner._maybe_post_backward(ctx.unit)
        return (None, *grads)


class Unit:
    """One unit's shard, full buffer, gathers and gradient reduction.

    Attributes:
        module: the unit's module; ``name``: its qualified name ("" for the root).
        params: its parameters in buffer order; ``offsets``: each one's first element.
        numel, padded, shard_numel: real elements, padded to a multiple of N, and N's share.
        shard: this rank's elements ``[rank*C, (rank+1)*C)``, in the parameters' dtype.
        full: the gathered buffer in ``param_dtype``; storage-less while ``state`` is FREE.
        grad_shard: this rank's averaged gradient (None until a reduction lands).
    """

    def __init__(self, owner: ShardedModel, index: int, name: str, module: nn.Module,
                 params: list[nn.Parameter], is_root: bool) -> None:
        self.owner, self.index, self.name, self.module = owner, index, name, module
        self.params, self.is_root = params, is_root
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"zero1.shard_model: unit {name or '<root>'!r} mixes parameter "
                             f"dtypes {sorted(map(str, dtypes))}; make it one unit per dtype")
        self.dtype = params[0].dtype
        floating = self.dtype.is_floating_point
        self.param_dtype = (owner.param_dtype if floating and owner.param_dtype else self.dtype)
        self.reduce_dtype = (owner.reduce_dtype if floating and owner.reduce_dtype
                             else self.param_dtype)
        n, rank = owner.world_size, owner.rank
        self.layout = FlatLayout.of([p.numel() for p in params], n)
        self.offsets = list(self.layout.offsets)
        self.numel, self.padded = self.layout.numel, self.layout.padded
        self.shard_numel = self.layout.shard_numel
        device = params[0].device
        flat = torch.zeros(self.padded, dtype=self.dtype, device=device)
        with torch.no_grad():
            for p, off in zip(params, self.offsets):
                flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
        # One rank, one dtype: the shard is the full buffer itself, always gathered.
        self.alias = n == 1 and self.param_dtype == self.dtype
        if self.alias:
            self.shard = flat
            self.full = flat
        else:
            self.shard = flat[self.layout.shard(rank)].clone()
            del flat
            self.full = torch.empty(self.padded, dtype=self.param_dtype, device=device)
        for p, off in zip(params, self.offsets):
            p.data = self.full[off:off + p.numel()].view(p.shape)
        self.trainable = [i for i, p in enumerate(params) if p.requires_grad]
        self.state = FULL
        self._work: Any = None
        self._source: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.used = torch.zeros(len(params), dtype=torch.bool)
        self._reset_backward()
        self.free()

    def _reset_backward(self) -> None:
        self.ready: set[int] = set()
        self.forward_calls = 0
        self.inputs_done = 0
        self.pre_backward_done = False
        self.post_backward_done = False

    # -------------------------------------------------------------- parameters
    def full_bytes(self) -> int:
        """Bytes the full buffer holds now (0 while freed)."""
        return self.full.untyped_storage().nbytes()

    def gather(self, async_op: bool = True) -> None:
        """Start (or do) the all-gather of the full buffer from the shards, if freed."""
        if self.state != FREE:
            return
        self.full.untyped_storage().resize_(self.padded * self.full.element_size())
        source = self.shard if self.param_dtype == self.dtype else self.shard.to(self.param_dtype)
        if self.owner.world_size == 1:
            self.full.copy_(source)
            self.state = FULL
            return
        self._source = source
        self._work = dist.all_gather_into_tensor(self.full, source, group=self.owner.group,
                                                 async_op=async_op)
        self.state = GATHERING
        if not async_op:
            self.wait()

    def wait(self) -> None:
        """Make the full buffer usable: gather now if freed, or wait for the prefetch."""
        if self.state == FREE:
            self.gather(async_op=False)
        if self.state == GATHERING:
            if self._work is not None:
                self._work.wait()
            self._work, self._source = None, None
            self.state = FULL

    def free(self) -> None:
        """Release the full buffer's storage (the parameters keep their shapes)."""
        if self.alias or self.state == FREE:
            return
        if self.state == GATHERING:
            self.wait()
        self.full.untyped_storage().resize_(0)
        self.state = FREE

    # -------------------------------------------------------------- gradients
    def reduce(self) -> None:
        """Pack the parameters' gradients, drop them, and start the reduce-scatter."""
        owner = self.owner
        flat = torch.empty(self.padded, dtype=self.reduce_dtype, device=self.shard.device)
        if self.padded > self.numel:
            flat[self.numel:].zero_()
        with torch.no_grad():
            for i, (p, off) in enumerate(zip(self.params, self.offsets)):
                piece = flat[off:off + p.numel()]
                if p.grad is None:
                    piece.zero_()
                    continue
                piece.copy_(p.grad.reshape(-1))
                p.grad = None
                self.used[i] = True
        if owner.world_size == 1:
            owner._landed(self, flat, None, None)
            return
        works, out = owner.collectives.reduce_scatter(flat, None, self.layout)
        owner._landed(self, out, works, flat)

    def add_reduced(self, summed: torch.Tensor) -> None:
        """Add a reduction's result (the sum of N ranks' gradients, or their average where
        the backend averages) into the averaged shard."""
        n = 1 if self.owner.collectives is None or self.owner.collectives.averages else (
            self.owner.world_size)
        if self.grad_shard is None:
            self.grad_shard = summed.to(self.dtype) if summed.dtype != self.dtype else summed
            if n > 1:
                self.grad_shard.div_(n)
        else:
            self.grad_shard.add_(summed.to(self.dtype), alpha=1.0 / n)


class ShardedModel:
    """The stage-3 state of one model: its units, hooks and reductions in flight.

    Made by :func:`shard_model`; found again with :func:`sharding_of`.

    Attributes:
        units: the units, innermost first, the root last.
        reshard_after_forward, param_dtype, reduce_dtype: as given to :func:`shard_model`.
        rank, world_size, group: the process group the shards are spread over.
    """

    def __init__(self, model: nn.Module, units: list[nn.Module], *, reshard_after_forward: bool,
                 param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None,
                 group: dist.ProcessGroup | None, rank: int, world_size: int) -> None:
        self.model_ref = weakref.ref(model)
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.group, self.rank, self.world_size = group, rank, world_size
        self.collectives: ShardCollectives | None = None
        if world_size > 1:
            ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
            self.collectives = ShardCollectives(group, rank, ranks)
        self.sync = True
        self.order: list[Unit] = []  # units in the order they first ran forward
        self._pending: list[tuple[Unit, torch.Tensor, Any, torch.Tensor | None]] = []
        self._callback_queued = False
        self._handles: list[Any] = []
        self.units = self._build_units(model, units)
        self._hook()

    # -------------------------------------------------------------- layout
    def _build_units(self, model: nn.Module, modules: list[nn.Module]) -> list[Unit]:
        names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        depth = {id(m): n.count(".") + 1 if n else 0 for n, m in
                 model.named_modules(remove_duplicate=False)}
        seen_modules: set[int] = set()
        for m in modules:
            if not isinstance(m, nn.Module):
                raise TypeError(f"zero1.shard_model: units must be modules, got {type(m).__name__}")
            if id(m) not in names:
                raise ValueError("zero1.shard_model: a unit is not a submodule of the model")
            if m is model:
                raise ValueError("zero1.shard_model: the model itself is always the root unit; "
                                 "list only its submodules")
            if id(m) in seen_modules:
                raise ValueError(f"zero1.shard_model: unit {names[id(m)]!r} is listed twice")
            seen_modules.add(id(m))
        # Each parameter goes to the innermost unit holding it; one held by two units
        # neither of which holds the other (tied across units) goes to the root.
        innermost_first = sorted(modules, key=lambda m: -depth[id(m)])
        owner: dict[int, nn.Module | None] = {}
        for m in innermost_first:
            inside = {id(x) for x in m.modules()}
            for p in m.parameters():
                if id(p) not in owner:
                    owner[id(p)] = m
                else:
                    held = owner[id(p)]
                    if held is not None and id(held) not in inside:
                        owner[id(p)] = None  # tied across units: the root's
        ordered: dict[int, list[nn.Parameter]] = {id(m): [] for m in [*innermost_first, model]}
        for p in model.parameters():  # registration order, tied ones once
            m = owner.get(id(p)) or model
            ordered[id(m)].append(p)
        units: list[Unit] = []
        for m in [*innermost_first, model]:
            params = ordered[id(m)]
            if params:
                units.append(Unit(self, len(units), names[id(m)], m, params, m is model))
        for unit in units:
            for i, p in enumerate(unit.params):
                p._zero1_stage3 = (self, unit, i)  # type: ignore[attr-defined]
        return units

    def _hook(self) -> None:
        # A gradient hook lives in its parameter's autograd metadata, out of the garbage
        # collector's sight, so a hook holding this object would keep a dropped model, its
        # shards and this object alive for good (a cycle the collector cannot break). They
        # hold it weakly instead, and the unit by its number. The module hooks are plain
        # Python attributes of the modules: the collector frees them with the model.
        this = weakref.ref(self)
        for unit in self.units:
            self._handles.append(unit.module.register_forward_pre_hook(
                _eager(lambda m, a, k, u=unit: self._pre_forward(u, a, k)), with_kwargs=True))
            self._handles.append(unit.module.register_forward_hook(
                _eager(lambda m, a, out, u=unit: self._post_forward(u, out))))
            for i in unit.trainable:
                hook = _eager(_gradient_hook(this, unit.index, i))
                self._handles.append(unit.params[i].register_post_accumulate_grad_hook(hook))

    # -------------------------------------------------------------- forward
    def _pre_forward(self, unit: Unit, args: tuple, kwargs: dict) -> Any:
        recomputing = _in_backward()  # activation checkpointing's second forward
        unit.wait()
        if not recomputing:
            if unit not in self.order:
                self.order.append(unit)
            else:
                position = self.order.index(unit)
                if position + 1 < len(self.order):
                    self.order[position + 1].gather(async_op=True)
        swap: dict[int, torch.Tensor] = {}
        if unit.param_dtype != unit.dtype:  # floating inputs in param_dtype, as FSDP2
            for t in _tensors((args, kwargs)):
                if t.is_floating_point() and t.dtype != unit.param_dtype:
                    swap[id(t)] = t.to(unit.param_dtype)
        flat = [swap.get(id(t), t) for t in _tensors((args, kwargs))]
        flat = [t for t in flat if t.requires_grad]
        if flat and torch.is_grad_enabled() and not recomputing:
            unit.forward_calls += 1
            cast = {id(v): k for k, v in swap.items()}
            for t, w in zip(flat, _PostBackward.apply(unit, *flat)):
                swap[cast.get(id(t), id(t))] = w
        if not swap:
            return None
        return _replace(args, swap), _replace(kwargs, swap)

    def _post_forward(self, unit: Unit, output: Any) -> None:
        if _in_backward():
            return  # recomputed: the backward about to run needs the parameters
        outputs = [t for t in _tensors(output) if t.requires_grad]
        for t in outputs:
            t.register_hook(_eager(lambda grad, u=unit: self._pre_backward(u)))
        backward_comes = torch.is_grad_enabled() and bool(outputs)
        if not backward_comes or (self.reshard_after_forward and not unit.is_root):
            unit.free()

    # -------------------------------------------------------------- backward
    def _queue_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(
                _eager(self._end_backward))

    def _pre_backward(self, unit: Unit) -> None:
        self._queue_callback()
        if unit.pre_backward_done:
            return
        unit.pre_backward_done = True
        unit.wait()
        if unit in self.order:
            position = self.order.index(unit)
            previous = self.order[-1] if unit.is_root else (
                self.order[position - 1] if position > 0 else None)
            if previous is not None and previous is not unit:
                previous.gather(async_op=True)

    def _grad_ready(self, unit: Unit, index: int) -> None:
        self._queue_callback()
        unit.ready.add(index)
        self._maybe_post_backward(unit)

    def _maybe_post_backward(self, unit: Unit) -> None:
        if unit.post_backward_done or len(unit.ready) < len(unit.trainable):
            return
        if unit.inputs_done < unit.forward_calls:
            return
        self._post_backward(unit)

    def _post_backward(self, unit: Unit) -> None:
        unit.post_backward_done = True
        if self.sync and unit.trainable:
            unit.reduce()
        unit.free()

    def _landed(self, unit: Unit, out: torch.Tensor, work: Any,
                buffer: torch.Tensor | None) -> None:
        """A reduction started: keep at most two in flight (their buffers are full-size)."""
        self._pending.append((unit, out, work, buffer))
        while len(self._pending) > 2:
            self._complete_one()

    def _complete_one(self) -> None:
        unit, out, works, _ = self._pending.pop(0)
        for work in works or ():
            work.wait()
        unit.add_reduced(out)

    def _end_backward(self) -> None:
        self._callback_queued = False
        for unit in self.units:
            if not unit.post_backward_done and (unit.pre_backward_done or unit.ready
                                                or unit.forward_calls):
                self._post_backward(unit)
        self.finish()
        for unit in self.units:
            unit.free()
            unit._reset_backward()

    # -------------------------------------------------------------- for the optimizer
    def finish(self) -> None:
        """Wait for every reduction in flight."""
        while self._pending:
            self._complete_one()

    def used_flags(self) -> torch.Tensor:
        """Per parameter (units in order), whether any rank gave it a gradient since the
        last ``zero_grad``; collective (one small all-reduce) on more than one rank."""
        flags = torch.cat([u.used for u in self.units]).to(torch.uint8)
        if self.world_size > 1:
            device = self.units[0].shard.device
            flags = flags.to(device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
            flags = flags.cpu()
        return flags.bool()

    def zero_grad(self) -> None:
        """Drop the averaged gradient shards and any full gradients kept by ``no_sync``."""
        for unit in self.units:
            unit.grad_shard = None
            unit.used.zero_()
            for p in unit.params:
                p.grad = None

    def reshard(self) -> None:
        """Free every full buffer (after a step they are stale)."""
        for unit in self.units:
            unit.free()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside keep full-size gradients in ``.grad`` (in ``param_dtype``)
        and send nothing; the next backward outside adds to them and reduces the sum."""
        before, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = before

    def gathered_bytes(self) -> int:
        """Bytes of full buffers allocated now (gathered or being gathered)."""
        return sum(u.full_bytes() for u in self.units if not u.alias)

    def shard_bytes(self) -> int:
        """Bytes of this rank's parameter shards."""
        return sum(u.shard.numel() * u.shard.element_size() for u in self.units
                   if not u.alias) + sum(u.numel * u.shard.element_size() for u in self.units
                                         if u.alias)

    # -------------------------------------------------------------- checkpoints
    @torch.no_grad()
    def full_state_dict(self, to: int | None = 0) -> dict[str, torch.Tensor] | None:
        """The model's ``state_dict`` with every parameter whole, in its own dtype, on the
        CPU (collective: one all-gather per unit). Returned on rank ``to`` only (None
        elsewhere), or on every rank with ``to=None``."""
        model = self.model_ref()
        assert model is not None
        full: dict[int, torch.Tensor] = {}
        want = to is None or to == self.rank
        for unit in self.units:
            if unit.alias or self.world_size == 1:
                flat = unit.shard
            else:
                flat = torch.empty(unit.padded, dtype=unit.dtype, device=unit.shard.device)
                dist.all_gather_into_tensor(flat, unit.shard, group=self.group)
            if want:
                for p, off in zip(unit.params, unit.offsets):
                    full[id(p)] = flat[off:off + p.numel()].view(p.shape).to("cpu", copy=True)
        if not want:
            return None
        out = {}
        for name, value in model.state_dict(keep_vars=True).items():
            out[name] = full[id(value)] if id(value) in full else value.detach().to(
                "cpu", copy=True)
        return out

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a full ``state_dict`` (every parameter whole): each rank copies its shard
        out of it. Not a collective, but call it on every rank. Checks every name and
        shape first; raises (changing nothing) on a mismatch."""
        model = self.model_ref()
        assert model is not None
        own = model.state_dict(keep_vars=True)
        missing = sorted(set(own) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(own))
        if missing or unexpected:
            raise ValueError(f"zero1 load_full_state_dict: missing keys {missing}, "
                             f"unexpected keys {unexpected}")
        for name, value in own.items():
            if tuple(state_dict[name].shape) != tuple(value.shape):
                raise ValueError(f"zero1 load_full_state_dict: {name} has shape "
                                 f"{list(state_dict[name].shape)}, the model's "
                                 f"{list(value.shape)}")
        by_id = {}
        for name, value in own.items():
            by_id.setdefault(id(value), (name, value))
        for _, (name, value) in by_id.items():
            info = getattr(value, "_zero1_stage3", None)
            source = state_dict[name]
            if info is None or info[0] is not self:
                value.copy_(source)
                continue
            _, unit, i = info
            self._load_into_shard(unit, i, source)
        self.reshard()

    def _load_into_shard(self, unit: Unit, i: int, source: torch.Tensor) -> None:
        p, off = unit.params[i], unit.offsets[i]
        c = unit.shard_numel
        lo, hi = max(off, self.rank * c), min(off + p.numel(), (self.rank + 1) * c)
        if unit.alias:
            lo, hi = off, off + p.numel()
            unit.shard[lo:hi].copy_(source.reshape(-1))
            return
        if lo < hi:
            flat = source.reshape(-1)
            unit.shard[lo - self.rank * c:hi - self.rank * c].copy_(flat[lo - off:hi - off])

    def remove(self) -> None:
        """Remove the hooks (the parameters stay sharded)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


# ------------------------------------------------------------------ the entry point
def default_units(model: nn.Module) -> list[nn.Module]:
    """Every entry of every ``nn.ModuleList`` in ``model`` (outermost lists; entries inside
    an entry are left to it): the blocks of a Transformer. The root holds the rest."""
    units: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and id(module) not in inside:
            for entry in module:
                units.append(entry)
                inside.update(id(m) for m in entry.modules())
            inside.add(id(module))
    return units


def shard_model(model: nn.Module, units: Iterable[nn.Module] | None = None, *,
                reshard_after_forward: bool = True, param_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype | None = None,
                process_group: dist.ProcessGroup | None = None) -> nn.Module:
    """Shard ``model``'s parameters over the ranks (ZeRO stage 3); returns ``model``.

    Then build the optimizer over ``model.parameters()`` with
    ``zero1.Stage3Optimizer``. Collective: call it on every rank, with the same model
    (the same parameters on every rank: each keeps its slice of them).

    Args:
        model: on this rank's device; do not move it afterwards.
        units: the modules gathered one at a time, such as the Transformer blocks; None:
            :func:`default_units`. The model itself is always the root unit, holding every
            parameter no other unit does (and a parameter tied across two units).
        reshard_after_forward: free each unit's full parameters after its forward and
            gather them again for its backward (3Ψ sent a step); False keeps them from
            the forward to the backward (2Ψ, more memory). The root is always kept.
        param_dtype: the dtype the parameters are gathered and computed in (e.g.
            ``torch.bfloat16``); None: their own. The shards keep their own dtype.
        reduce_dtype: the dtype gradients are reduce-scattered in; None: ``param_dtype``.
        process_group: the group to shard over; None: the default one (or one rank
            without ``torch.distributed``).

    Raises:
        TypeError, ValueError: bad arguments, before any collective.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"zero1.shard_model: expected an nn.Module, got {type(model).__name__}")
    if sharding_of(model) is not None:
        raise ValueError("zero1.shard_model: this model is sharded already")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError("zero1.shard_model: reshard_after_forward must be a bool")
    for name, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"zero1.shard_model: {name} must be a floating torch.dtype or None, "
                            f"got {dtype!r}")
    params = list(model.parameters())
    if not params:
        raise ValueError("zero1.shard_model: the model has no parameters")
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"zero1.shard_model: parameters on several devices "
                         f"({', '.join(sorted(map(str, devices)))})")
    chosen = default_units(model) if units is None else list(units)
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
        layout = [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, layout, group=process_group)
        if any(other != everyone[0] for other in everyone):
            raise ValueError("zero1.shard_model: ranks hold models with different parameters")
    else:
        rank, world = 0, 1
    sharded = ShardedModel(model, chosen, reshard_after_forward=reshard_after_forward,
                           param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                           group=process_group, rank=rank, world_size=world)
    model._zero1_stage3 = sharded  # type: ignore[assignment]
    return model


def sharding_of(model: nn.Module) -> ShardedModel | None:
    """The :class:`ShardedModel` of a model passed to :func:`shard_model`, else None."""
    found = model.__dict__.get("_zero1_stage3")
    return found if isinstance(found, ShardedModel) else None
