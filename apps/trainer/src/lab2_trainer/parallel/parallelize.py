"""The data-parallel and sharding choices of a run, applied by one function.

:func:`parallelize` sets up a bare model for training in a fixed order (as torchtitan's
``parallelize.py`` does): the blocks' float8 matrix products first, for ``--precision fp8``
(:mod:`lab2_trainer.models.float8`), then compilation (each block of the bare model on its
own, or the whole model: :func:`compile_model`), then the sharding kind's family, which wraps,
hooks or shards the model and builds the optimizer. It returns that family's
:class:`Parallel`: what the training step calls (the training forward, ``no_sync()``,
``finish()``, ``clip_grad_norm_`` and the optimizer), plus the full (unsharded) model and
optimizer state for checkpoints, in the trainer's one format whatever the kind.

Each family is one small class with the same methods (:data:`FAMILIES` maps the
``--sharding`` kinds to them):

==================  ==============================  ==============================
family (kinds)      gradients averaged by           optimizer
==================  ==============================  ==============================
:class:`DDP`        the ``--ddp`` wrapper:          AdamW (none),
(none,              minddp's four, PyTorch's DDP,   ShardedOptimizer(reduce_gradients
zero1-allreduce,    or none (one rank)              =False) (zero1-allreduce),
torch)                                              ZeroRedundancyOptimizer (torch)
:class:`Zero`       ShardedOptimizer's hooks:       ShardedOptimizer(stage=1 or 2,
(zero1, zero2)      reduce-scatter in backward      reduce_gradients=True)
:class:`Zero3`      zero1.shard_model's hooks:      Stage3Optimizer(AdamW) over
(zero3)             reduce-scatter in backward      the parameter shards
:class:`FSDP`       FSDP2 (reduce-scatter)          AdamW over the sharded parameters
(fsdp)
==================  ==============================  ==============================

With ``muon`` (``--optimizer muon``) each family makes ``zero1.Muon`` over the blocks'
matrices the same way beside its AdamW over the rest, stepped as one
(:mod:`lab2_trainer.parallel.optimizers`); FSDP2's row shards and tensor parallelism cut
the matrices Muon needs whole, and are refused
(:func:`lab2_trainer.recipe.muon.muon_problem`).

**On a mesh** (``--tp`` > 1): the ranks are ``dp x tp``
(:class:`lab2_trainer.parallel.mesh.Mesh`), the model is first cut over its
tensor-parallel group (:func:`lab2_trainer.parallel.tensor.shard_transformer`), and the
family then runs over its data-parallel group only, wrapped in
:class:`~lab2_trainer.parallel.tensor.TensorParallel`: the gradients of whole parameters
summed over the tensor-parallel group where sequence parallelism leaves them partial,
clipping by the norm of one process, the whole model gathered from the shards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from lab2_trainer.parallel.mesh import Mesh

# param_groups: its callers import it from here, where it lived before optimizers.py.
from lab2_trainer.parallel.optimizers import (  # noqa: F401
    MuonSettings,
    build,
    param_groups,
    plain,
)
from lab2_trainer.parallel.tensor import TensorParallel, shard_transformer
from lab2_trainer.recipe.muon import muon_problem


def fused_adamw_available(device: torch.device) -> bool:
    """Whether the trainer steps AdamW with its fused kernels on ``device``: on CUDA. The
    CPU has them too (torch >= 2.4), but CPU runs are tests and demos, which keep the
    default arithmetic their oracles use."""
    return device.type == "cuda"


@dataclass
class Options:
    """What every family's :meth:`Parallel.apply` takes besides the model.

    Attributes:
        ddp: the ``--ddp`` wrapper ("none" for the families that average gradients
            themselves).
        device: this rank's device.
        lr, betas, weight_decay, fused: AdamW's.
        bucket_mb, bucket_rule: the DDP wrappers' buckets and zero1/zero2's.
        reduce_dtype: the DDP wrapper's wire dtype (:func:`ddp_wrapper`).
        reshard_after_forward: zero3's and FSDP2's.
        group: the process group the family averages over (None: the default group;
            on a mesh, the data-parallel one).
        muon: Muon's settings for the blocks' matrices (None: AdamW alone).
    """

    ddp: str
    device: torch.device
    lr: float
    betas: tuple[float, float]
    weight_decay: float
    fused: bool = False
    bucket_mb: float = 25.0
    bucket_rule: str = "reach"
    reduce_dtype: torch.dtype | None = None
    reshard_after_forward: bool = True
    group: dist.ProcessGroup | None = None
    muon: MuonSettings | None = None

    def adamw(self) -> dict[str, Any]:
        """AdamW's keyword arguments (the parameter groups apart)."""
        kwargs: dict[str, Any] = dict(lr=self.lr, betas=self.betas, eps=1e-8)
        if self.fused:
            kwargs["fused"] = True
        return kwargs

    def optimizer(self, model: nn.Module, make: Any = plain) -> Any:
        """The run's optimizer over ``model``, each optimizer in it made by ``make`` (the
        family's): AdamW, or Muon with AdamW (:func:`lab2_trainer.parallel.optimizers.build`)."""
        return build(model, make, weight_decay=self.weight_decay, adamw=self.adamw(),
                     muon=self.muon)


class Parallel:
    """A model set up for training: what the training step calls. The base class is one
    process with nothing to average (the benchmarks' single-device step); each family
    subclasses it, overriding the methods where it differs, and builds itself in
    :meth:`apply`.

    Attributes:
        model: the bare model (with "fsdp" its parameters are sharded DTensors).
        optimizer: steps the parameters.
        forward: what the training forward calls (the DDP wrapper, if any, around the
            compiled or bare model).
        eval_module: what evaluation forwards through (no DDP wrapper; compiled when the
            run compiles; the FSDP root with "fsdp", so every rank must evaluate).
        sharding, ddp: the kinds (``--sharding``, ``--ddp``).
        wrapper: the DDP wrapper module, or None.
        group: the process group gradients are averaged over (None: the default group).
    """

    #: Whether each rank holds a part of the averaged gradients (True) or all of them.
    dp_sharded: ClassVar[bool] = False

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 forward: nn.Module | None = None, *, eval_module: nn.Module | None = None,
                 sharding: str = "none", ddp: str = "none",
                 wrapper: nn.Module | None = None,
                 group: dist.ProcessGroup | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.forward = model if forward is None else forward
        self.eval_module = self.forward if eval_module is None else eval_module
        self.sharding = sharding
        self.ddp = ddp
        self.wrapper = wrapper
        self.group = group

    @classmethod
    def apply(cls, model: nn.Module, compiled: nn.Module, sharding: str,
              options: Options) -> Parallel:
        """Set the family up on ``model`` (``compiled``: its compiled form, or itself)."""
        raise NotImplementedError

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The training forward."""
        return self.forward(*args, **kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Accumulate gradients locally, with no communication (all micro-batches but the
        last of a step)."""
        return contextlib.nullcontext()

    def finish(self) -> None:
        """Wait for or perform the gradient averaging (after a step's last backward)."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the averaged gradients to a global 2-norm of ``max_norm`` (``inf``: only
        measure it); returns the norm before clipping, a plain tensor on every rank."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        return _full_tensor(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def held_gradients(self) -> list[tuple[str, int, torch.Tensor]]:
        """The averaged gradients this rank holds after :meth:`finish`, as (parameter
        name, offset in the parameter's flat view, gradient): the model's ``.grad``."""
        return [(name, 0, p.grad) for name, p in self.model.named_parameters()
                if p.grad is not None]

    @property
    def gradient_order(self) -> list[int] | None:
        """The learned bucket order, for checkpoints (minddp's launch order, zero1's bucket
        order); None where nothing is learned."""
        return None

    def set_gradient_order(self, order: list[int] | None) -> None:
        """Launch along a checkpoint's ``gradient_order`` (where a wrapper learns one), so
        that a resumed run cuts and sums its buckets as the interrupted one did."""

    # ----------------------------------------------------------------- checkpoints
    def full_model_state(self, rank: int) -> dict[str, torch.Tensor] | None:
        """The model's whole state dict on rank 0, None elsewhere (a collective where the
        model is sharded: call it on every rank)."""
        return self.model.state_dict() if rank == 0 else None

    def full_optimizer_state(self, rank: int) -> dict | None:
        """The whole optimizer state in plain AdamW's format (state keyed by parameter
        number, in ``param_groups``' order; with Muon, AdamW's groups then Muon's) on rank
        0, None elsewhere; loadable by any kind at any world size. A collective for sharded
        optimizers: call it on every rank."""
        if hasattr(self.optimizer, "consolidate_state_dict"):
            self.optimizer.consolidate_state_dict(to=0)
        return self.optimizer.state_dict() if rank == 0 else None

    def load_full_optimizer_state(self, state: dict) -> None:
        """Load a whole state of :meth:`full_optimizer_state`'s format, on every rank."""
        # ZeroRedundancyOptimizer edits the dict it is given; hand it a copy.
        state = {"state": dict(state["state"]),
                 "param_groups": [dict(g) for g in state["param_groups"]]}
        self.optimizer.load_state_dict(state)


def _agree_and_broadcast(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Check that the ranks' models agree and broadcast the group's first rank's parameters
    and buffers (what the DDP wrappers do in their constructors) for the families without
    one."""
    if dist.is_available() and dist.is_initialized():
        from minddp import broadcast_module, check_model_consistency

        check_model_consistency(model, process_group=group)
        broadcast_module(model, process_group=group)


# ------------------------------------------------------------------ the DDP wrappers
def _bucketed(module: nn.Module, o: Options) -> nn.Module:
    from minddp import DDPBucketed

    return DDPBucketed(module, bucket_size_mb=o.bucket_mb, reduce_dtype=o.reduce_dtype,
                       bucket_rule=o.bucket_rule, process_group=o.group)


def _individual(module: nn.Module, o: Options) -> nn.Module:
    from minddp import DDPIndividualParameters

    return DDPIndividualParameters(module, process_group=o.group)


def _torch_ddp(module: nn.Module, o: Options) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    hook = _compress_hook(o.reduce_dtype)
    device_ids = [o.device.index] if o.device.type == "cuda" else None
    wrapper = DistributedDataParallel(module, device_ids=device_ids, bucket_cap_mb=o.bucket_mb,
                                      process_group=o.group)
    if hook is not None:
        wrapper.register_comm_hook(None, hook)
    return wrapper


#: The ``--ddp`` kinds that wrap the forward module, and how; "flat" and "naive" average
#: after backward (:meth:`DDP.finish`) and "none" does nothing.
WRAPPERS: dict[str, Callable[[nn.Module, Options], nn.Module]] = {
    "bucketed": _bucketed, "individual": _individual, "torch": _torch_ddp}
#: The minddp wrappers that hook gradients and learn a launch order.
MINDDP_HOOKED = ("bucketed", "individual")
#: What reduce_dtype applies to (DDPBucketed's ``reduce_dtype``; PyTorch's DDP compression).
REDUCE_DTYPE_KINDS = ("bucketed", "torch")


def ddp_wrapper(module: nn.Module, kind: str, options: Options) -> nn.Module | None:
    """The ``--ddp`` wrapper of kind ``kind`` around ``module``, or None for "flat",
    "naive" and "none".

    Raises:
        ValueError: an unknown kind, or a ``reduce_dtype`` the kind cannot average in.
    """
    from lab2_trainer.recipe.layout import DDP_KINDS

    if kind not in DDP_KINDS:
        raise ValueError(f"unknown ddp kind {kind!r}")
    if options.reduce_dtype is not None and kind not in REDUCE_DTYPE_KINDS:
        raise ValueError(f"ddp kind {kind!r} averages gradients in their own dtype; "
                         "reduce_dtype is for 'bucketed' and 'torch'")
    return WRAPPERS[kind](module, options) if kind in WRAPPERS else None


class DDP(Parallel):
    """A ``--ddp`` wrapper averages the gradients (sharding none, zero1-allreduce, torch):
    AdamW plain, zero1's ShardedOptimizer broadcasting its updated shards, or PyTorch's
    ZeroRedundancyOptimizer."""

    @classmethod
    def apply(cls, model: nn.Module, compiled: nn.Module, sharding: str,
              options: Options) -> Parallel:
        wrapper = ddp_wrapper(compiled, options.ddp, options)
        if wrapper is None and options.ddp != "none":
            from minddp import broadcast_module

            broadcast_module(model, process_group=options.group)  # as the wrappers do
        if sharding == "none":
            optimizer = options.optimizer(model)
        elif sharding == "zero1-allreduce":
            from zero1 import ShardedOptimizer

            optimizer = options.optimizer(model, lambda groups, cls, **kw: ShardedOptimizer(
                groups, cls, reduce_gradients=False, process_group=options.group, **kw))
        else:  # "torch"
            from torch.distributed.optim import ZeroRedundancyOptimizer

            optimizer = options.optimizer(model, lambda groups, cls, **kw: (
                ZeroRedundancyOptimizer(groups, optimizer_class=cls,
                                        process_group=options.group, **kw)))
        return cls(model, optimizer, wrapper or compiled, eval_module=compiled,
                   sharding=sharding, ddp=options.ddp, wrapper=wrapper, group=options.group)

    def no_sync(self) -> contextlib.AbstractContextManager:
        # The wrappers' own; the baselines reduce only when finish() is called.
        return self.wrapper.no_sync() if self.wrapper is not None else contextlib.nullcontext()

    def finish(self) -> None:
        if self.ddp in MINDDP_HOOKED:
            self.wrapper.finish_gradient_synchronization()
        elif (self.wrapper is None and self.ddp != "none"
              and dist.get_world_size(self.group) > 1):
            from minddp import all_reduce_gradients

            all_reduce_gradients(self.model, flat=self.ddp == "flat", process_group=self.group)
        # PyTorch's DDP has finished inside backward; "none" has nothing to do.

    @property
    def gradient_order(self) -> list[int] | None:
        return self.wrapper.gradient_order if self.ddp in MINDDP_HOOKED else None

    def set_gradient_order(self, order: list[int] | None) -> None:
        if order is not None and self.ddp in MINDDP_HOOKED:
            self.wrapper.set_gradient_order(order)


def _compress_hook(reduce_dtype: torch.dtype | None) -> Any:
    """PyTorch DDP's communication hook that averages gradients in ``reduce_dtype``."""
    if reduce_dtype is None:
        return None
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hooks = {torch.bfloat16: default_hooks.bf16_compress_hook,
             torch.float16: default_hooks.fp16_compress_hook}
    if reduce_dtype not in hooks:
        raise ValueError(f"PyTorch's DDP averages gradients in bfloat16 or float16 (its "
                         f"compression hooks), not {reduce_dtype}")
    return hooks[reduce_dtype]


# ------------------------------------------------------------------------------ zero
class _OptimizerReduces(Parallel):
    """What zero and zero3 share: zero1's optimizer averages the gradients itself, so it
    holds the averaged gradients (the model's ``.grad`` are not) and does the step's
    communication."""

    dp_sharded: ClassVar[bool] = True

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.optimizer.no_sync()

    def finish(self) -> None:
        self.optimizer.finish_gradient_synchronization()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        # The averaged gradients are the optimizer's shards (one scalar all-reduce).
        return self.optimizer.clip_grad_norm_(max_norm, norm_type=2.0)

    def held_gradients(self) -> list[tuple[str, int, torch.Tensor]]:
        # The pieces the optimizer steps, each a range of one parameter.
        names = _parameter_names(self.model)
        return [(names[id(piece.param)][0], piece.start, piece.local.grad)
                for _, piece in self.optimizer.numbered_pieces()
                if piece.local.grad is not None]


class Zero(_OptimizerReduces):
    """zero1's ShardedOptimizer averages the gradients itself (zero1, zero2: stage 1 or
    2), reduce-scattering them in buckets during backward; no DDP wrapper."""

    #: ShardedOptimizer's stage of each kind.
    STAGES: ClassVar[dict[str, int]] = {"zero1": 1, "zero2": 2}

    @classmethod
    def apply(cls, model: nn.Module, compiled: nn.Module, sharding: str,
              options: Options) -> Parallel:
        from zero1 import ShardedOptimizer

        _agree_and_broadcast(model, options.group)
        optimizer = options.optimizer(model, lambda groups, opt_cls, **kw: ShardedOptimizer(
            groups, opt_cls, stage=cls.STAGES[sharding], reduce_gradients=True,
            bucket_size_mb=options.bucket_mb, bucket_rule=options.bucket_rule,
            process_group=options.group, **kw))
        return cls(model, optimizer, compiled, sharding=sharding, group=options.group)

    @property
    def gradient_order(self) -> list[int] | None:
        # The order ShardedOptimizer's buckets follow after the first step.
        return self.optimizer.gradient_order

    def set_gradient_order(self, order: list[int] | None) -> None:
        self.optimizer.set_gradient_order(order)  # a collective


# ----------------------------------------------------------------------------- zero3
class Zero3(_OptimizerReduces):
    """zero1's stage 3 (zero3): ``zero1.shard_model`` with every transformer block a unit
    and the root holding the rest (FSDP2's layout), gathering each unit before its
    forward and backward and reduce-scattering its gradients after; ``Stage3Optimizer``
    steps the shards. Clipping, the full state and evaluation are collectives."""

    @classmethod
    def apply(cls, model: nn.Module, compiled: nn.Module, sharding: str,
              options: Options) -> Parallel:
        from zero1 import Stage3Optimizer, shard_model

        _agree_and_broadcast(model, options.group)
        shard_model(model, units=list(getattr(model, "blocks", ())),
                    reshard_after_forward=options.reshard_after_forward,
                    process_group=options.group)
        optimizer = options.optimizer(model, Stage3Optimizer)
        return cls(model, optimizer, compiled, sharding=sharding, group=options.group)

    def full_model_state(self, rank: int) -> dict[str, torch.Tensor] | None:
        from zero1 import sharding_of

        return sharding_of(self.model).full_state_dict(to=0)


# ------------------------------------------------------------------------------ fsdp
class FSDP(Parallel):
    """PyTorch's FSDP2: ``fully_shard`` on every transformer block and then the root;
    plain AdamW over the sharded parameters. The gradients are reduce-scattered inside
    backward, and clipping, checkpoints and evaluation are collectives."""

    dp_sharded: ClassVar[bool] = True

    @classmethod
    def apply(cls, model: nn.Module, compiled: nn.Module, sharding: str,
              options: Options) -> Parallel:
        _agree_and_broadcast(model, options.group)
        _fully_shard(model, options.device, options.reshard_after_forward, options.group)
        return cls(model, options.optimizer(model), compiled, sharding=sharding,
                   group=options.group)

    def held_gradients(self) -> list[tuple[str, int, torch.Tensor]]:
        # This rank's rows of each parameter's gradient (a view: scaling it scales them).
        return [(name, 0, p.grad.to_local()) for name, p in self.model.named_parameters()
                if p.grad is not None]

    def whole_state(self) -> dict[str, torch.Tensor]:
        """The model's state dict with every tensor whole, on every rank (a collective)."""
        return {k: _full_tensor(v) for k, v in self.model.state_dict().items()}

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def full_model_state(self, rank: int) -> dict[str, torch.Tensor] | None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(self.model, options=_full_options(cpu_offload=True))
        return state if rank == 0 else None

    def full_optimizer_state(self, rank: int) -> dict | None:
        """The whole optimizer state in plain AdamW's format (state keyed by parameter
        number, in ``param_groups``' order) on rank 0, None elsewhere; loadable by any
        kind at any world size. A collective: call it on every rank."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        by_name = get_optimizer_state_dict(self.model, self.optimizer,
                                           options=_full_options(cpu_offload=True))
        if rank != 0:
            return None
        names = _parameter_names(self.model)
        state: dict[int, Any] = {}
        groups = []
        number = 0
        for ours, theirs in zip(self.optimizer.param_groups, by_name["param_groups"]):
            ids = []
            for p in ours["params"]:
                found = [n for n in names[id(p)] if n in by_name["state"]]
                if found:
                    state[number] = by_name["state"][found[0]]
                ids.append(number)
                number += 1
            groups.append({**{k: v for k, v in theirs.items() if k != "params"},
                           "params": ids})
        return {"state": state, "param_groups": groups}

    def load_full_optimizer_state(self, state: dict) -> None:
        """Load a whole state of :meth:`full_optimizer_state`'s format, on every rank (a
        collective with "fsdp")."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        names = _parameter_names(self.model)
        saved_groups = state["param_groups"]
        if len(saved_groups) != len(self.optimizer.param_groups):
            raise ValueError(f"it has {len(saved_groups)} parameter groups, the optimizer "
                             f"{len(self.optimizer.param_groups)}")
        by_name: dict[str, Any] = {}
        groups = []
        for i, (ours, saved) in enumerate(zip(self.optimizer.param_groups, saved_groups)):
            if len(ours["params"]) != len(saved["params"]):
                raise ValueError(f"parameter group {i} has {len(saved['params'])} "
                                 f"parameters, the optimizer's {len(ours['params'])}")
            fqns = [names[id(p)][0] for p in ours["params"]]
            for fqn, number in zip(fqns, saved["params"]):
                if number in state["state"]:
                    by_name[fqn] = state["state"][number]
            groups.append({**{k: v for k, v in saved.items() if k != "params"},
                           "params": fqns})
        set_optimizer_state_dict(self.model, self.optimizer,
                                 {"state": by_name, "param_groups": groups},
                                 options=_full_options(cpu_offload=False))


def _full_options(cpu_offload: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)


def _parameter_names(model: nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter (a tied one has several), by ``id``."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


#: The family of each ``--sharding`` kind.
FAMILIES: dict[str, type[Parallel]] = {
    "none": DDP, "zero1-allreduce": DDP, "torch": DDP,
    "zero1": Zero, "zero2": Zero,
    "zero3": Zero3,
    "fsdp": FSDP,
}


def parallelize(model: nn.Module, *, sharding: str, ddp: str, device: torch.device,
                lr: float, betas: tuple[float, float], weight_decay: float,
                fused: bool = False, compile: dict[str, Any] | None = None,
                bucket_mb: float = 25.0, bucket_rule: str = "reach",
                reduce_dtype: torch.dtype | None = None,
                reshard_after_forward: bool = True, mesh: Mesh | None = None,
                sequence_parallel: bool = False, float8: str | None = None,
                muon: MuonSettings | None = None) -> Parallel:
    """Set ``model`` up for training: the one place that applies parallelism, in a fixed
    order.

    0. Tensor parallelism, on a ``mesh`` whose "tp" dimension has more than one rank: the
       model is cut over its tensor-parallel group
       (:func:`~lab2_trainer.parallel.tensor.shard_transformer`, with
       ``sequence_parallel``), and everything after runs over the data-parallel group.
    1. Float8: with ``float8`` (a recipe of ``config.FP8_RECIPES``) the blocks'
       ``nn.Linear`` become torchao's ``Float8Linear``
       (:func:`lab2_trainer.models.float8.convert_blocks`; emulated off CUDA), keeping
       their weight ``Parameter`` objects, so everything after sees ordinary parameters:
       the compiled blocks trace the float8 casts and products, a checkpointed block
       recomputes them, and the wrappers, zero1's stages and FSDP2 shard plain weights
       (FSDP2 gathers them in fp32, not float8). Not with tensor parallelism.
    2. Compilation: with ``compile`` (:func:`compile_model`'s arguments), the bare model
       (cut, under tensor parallelism: minitp's collectives trace as functional
       collectives) is compiled block by block, or whole; everything after wraps or hooks the bare
       model's modules and parameters, so the DDP wrappers' and zero1's gradient hooks
       and FSDP2's module hooks still fire around the compiled graphs.
    3. The family of ``sharding`` (:data:`FAMILIES`) applies itself: a DDP wrapper around
       the compiled module, or (zero, zero3, fsdp) the ranks' models checked to agree
       (``minddp.check_model_consistency``), rank 0's weights broadcast and, for fsdp,
       ``fully_shard`` (for zero3 ``zero1.shard_model``); then the family's optimizer
       (zero's registers its gradient hooks).

    Args:
        model: the bare model, on ``device``, identical on every rank.
        sharding: one of ``recipe.layout.SHARDING_KINDS``.
        ddp: one of ``recipe.layout.DDP_KINDS`` ("none" with zero1, zero2, zero3 and fsdp).
        device: this rank's device.
        lr, betas, weight_decay, fused: AdamW's.
        compile: torch.compile's backend and mode and the scope (:func:`compile_model`),
            or None.
        bucket_mb, bucket_rule: DDP's buckets and zero1/zero2's.
        reduce_dtype: the DDP wrapper's wire dtype (:func:`ddp_wrapper`).
        reshard_after_forward: for "zero3" and "fsdp".
        mesh: the ranks as "dp" x "tp" (:class:`~lab2_trainer.parallel.mesh.Mesh`); None:
            every rank data-parallel.
        sequence_parallel: with tensor parallelism, cut the residual stream along the
            sequence too.
        float8: the float8 recipe of the blocks' matrix products (``--precision fp8``'s
            ``--fp8-recipe``), or None: as autocast computes them.
        muon: step the blocks' matrices with Muon, the rest with AdamW
            (:mod:`lab2_trainer.parallel.optimizers`); None: AdamW alone.
    """
    from lab2_trainer.recipe.layout import SELF_REDUCING

    if sharding not in FAMILIES:
        raise ValueError(f"unknown sharding {sharding!r}")
    if sharding in SELF_REDUCING and ddp != "none":
        raise ValueError(f"sharding {sharding!r} averages gradients itself: ddp must be "
                         f"'none', not {ddp!r}")
    problem = muon_problem("muon" if muon else "adamw", sharding,
                           mesh.size("tp") if mesh is not None else 1)
    if problem is not None:
        raise ValueError(problem)
    layout = None
    tensor_parallel = mesh is not None and mesh.size("tp") > 1
    if float8 is not None:
        if tensor_parallel:
            raise ValueError("float8 products with tensor parallelism are not supported yet: "
                             "the tensor-parallel layers are not nn.Linear")
        from lab2_trainer.models.float8 import convert_blocks

        convert_blocks(model, float8)
    if tensor_parallel:
        layout = shard_transformer(model, mesh.group("tp"), sequence_parallel=sequence_parallel)
    elif sequence_parallel:
        raise ValueError("sequence parallelism needs a mesh with more than one "
                         "tensor-parallel rank")
    compiled = model if compile is None else compile_model(model, **compile)
    options = Options(ddp=ddp, device=device, lr=lr, betas=betas, weight_decay=weight_decay,
                      fused=fused, bucket_mb=bucket_mb, bucket_rule=bucket_rule,
                      reduce_dtype=reduce_dtype, reshard_after_forward=reshard_after_forward,
                      group=mesh.group("dp") if mesh is not None else None, muon=muon)
    parallel = FAMILIES[sharding].apply(model, compiled, sharding, options)
    return parallel if layout is None else TensorParallel(parallel, mesh, layout)


def compile_model(model: nn.Module, *, backend: str = "inductor", mode: str | None = None,
                  scope: str = "blocks") -> nn.Module:
    """Compile ``model`` with ``torch.compile(backend=, mode=)``; returns what the training
    forward calls.

    Args:
        scope: "blocks": regional compilation, in place
            (``TransformerLM.compile_regions``: each block on its own, one graph serving
            every block, and the embedding and the head); the model itself is returned.
            "model": the whole model as one graph (``torch.compile(model)``, a wrapper;
            the model itself stays uncompiled).
    """
    if scope == "blocks":
        model.compile_regions(backend=backend, mode=mode)
        return model
    if scope == "model":
        return torch.compile(model, backend=backend, mode=mode)
    raise ValueError(f"compile scope must be 'blocks' or 'model', got {scope!r}")


def warm_compiler(backend: str) -> None:
    """Start inductor's pool of compile workers now; inductor starts it itself at its first
    compilation, but the workers take seconds to start, and started early they do so while
    the run loads its data and builds its model. Nothing for other backends, or where this
    torch has no such pool."""
    if backend != "inductor":
        return
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:
        return
    maybe_warm_pool()


def build_optimizer(model: nn.Module, *, lr: float, betas: tuple[float, float],
                    weight_decay: float, fused: bool = False) -> torch.optim.Optimizer:
    """The trainer's unsharded AdamW over ``model`` (:func:`param_groups`), as the "none"
    and "fsdp" kinds build it."""
    return Options("none", torch.device("cpu"), lr, betas, weight_decay, fused).optimizer(model)


def fully_shard_fn() -> Any:
    """PyTorch's FSDP2 ``fully_shard`` (``torch.distributed.fsdp``; older torch keeps it
    under ``torch.distributed._composable.fsdp``)."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def _full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective); a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _fully_shard(model: nn.Module, device: torch.device, reshard_after_forward: bool,
                 group: dist.ProcessGroup | None = None) -> None:
    """FSDP2 over the ranks of ``group`` (None: the default group): each transformer block
    (``model.blocks``) is a unit of its own, the root holds the rest (embeddings, final
    norm, head)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    fully_shard = fully_shard_fn()
    if group is None:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    else:  # one dimension of a larger mesh: its group as a mesh of its own
        mesh = DeviceMesh.from_group(group, device.type)
    for block in getattr(model, "blocks", ()):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
