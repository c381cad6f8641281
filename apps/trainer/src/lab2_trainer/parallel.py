"""The data-parallel and sharding choices of a run, applied by one function.

:func:`parallelize` sets up a bare model for training in a fixed order (as torchtitan's
``parallelize.py`` does): compilation first (each block of the bare model on its own, or
the whole model), then data parallelism and sharding (a DDP wrapper, zero1's gradient
hooks, or FSDP2's ``fully_shard``), then the optimizer. It returns a :class:`Parallel`,
which is what the training step needs: ``forward``, ``no_sync()``, ``finish()``,
``clip_grad_norm_`` and the optimizer, plus the full (unsharded) model and optimizer state
for checkpoints, in the trainer's one format whatever the kind.

:class:`GradSync` hides which DDP wrapper averages gradients (minddp's four, PyTorch's
DistributedDataParallel, or none); :func:`build_optimizer` builds AdamW plain, sharded by
zero1 (stage 1 or 2, reducing gradients itself or not), or sharded by PyTorch's
ZeroRedundancyOptimizer.

The sharding kinds (``--sharding``):

==================  ==============================  ==============================
kind                gradients averaged by           optimizer
==================  ==============================  ==============================
none                the ``--ddp`` wrapper            AdamW
zero1, zero2        ShardedOptimizer's hooks:       ShardedOptimizer(stage=1 or 2,
                    reduce-scatter in backward      reduce_gradients=True)
zero1-allreduce     the ``--ddp`` wrapper            ShardedOptimizer(reduce_gradients=False)
torch               the ``--ddp`` wrapper            ZeroRedundancyOptimizer(AdamW)
fsdp                FSDP2 (reduce-scatter)          AdamW over the sharded parameters
==================  ==============================  ==============================
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

#: The GradSync kinds whose minddp wrapper hooks gradients and learns a launch order.
MINDDP_HOOKED = ("bucketed", "individual")


class GradSync:
    """Forward through the chosen wrapper; average gradients after the last micro-batch.

    Args:
        model: the bare model (its parameters are what gets averaged).
        forward_module: what to call for the forward (the model or its compiled form).
        kind: "bucketed", "individual", "flat", "naive", "torch" or "none".
        bucket_mb: bucket size in MiB for "bucketed" and "torch".
        device: the rank's device (PyTorch's DDP wants its index on GPU).
        reduce_dtype: the dtype gradients travel and are averaged in, for "bucketed"
            (DDPBucketed's ``reduce_dtype``) and "torch" (PyTorch's bfloat16 or float16
            compression hook); None: their own dtype.
        bucket_rule: how ``bucket_mb`` cuts "bucketed"'s buckets (DDPBucketed's
            ``bucket_rule``; PyTorch's DDP always closes a bucket once it reaches the size,
            which is "reach").
    """

    def __init__(self, model: nn.Module, forward_module: nn.Module, kind: str, bucket_mb: float,
                 device: torch.device, *, reduce_dtype: torch.dtype | None = None,
                 bucket_rule: str = "reach") -> None:
        self.kind = kind
        self.model = model
        self.wrapper: nn.Module | None = None
        if reduce_dtype is not None and kind not in ("bucketed", "torch"):
            raise ValueError(f"ddp kind {kind!r} averages gradients in their own dtype; "
                             "reduce_dtype is for 'bucketed' and 'torch'")
        if kind == "bucketed":
            from minddp import DDPBucketed

            self.wrapper = DDPBucketed(forward_module, bucket_size_mb=bucket_mb,
                                       reduce_dtype=reduce_dtype, bucket_rule=bucket_rule)
        elif kind == "individual":
            from minddp import DDPIndividualParameters

            self.wrapper = DDPIndividualParameters(forward_module)
        elif kind == "torch":
            from torch.nn.parallel import DistributedDataParallel

            hook = _compress_hook(reduce_dtype)
            device_ids = [device.index] if device.type == "cuda" else None
            self.wrapper = DistributedDataParallel(
                forward_module, device_ids=device_ids, bucket_cap_mb=bucket_mb
            )
            if hook is not None:
                self.wrapper.register_comm_hook(None, hook)
        elif kind in ("flat", "naive"):
            from minddp import broadcast_module

            broadcast_module(model)  # the wrappers do this in their constructors
        elif kind != "none":
            raise ValueError(f"unknown ddp kind {kind!r}")
        self.forward_module = self.wrapper if self.wrapper is not None else forward_module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (all micro-batches but the last)."""
        if self.wrapper is not None:
            with self.wrapper.no_sync():
                yield
        else:
            yield  # the baselines reduce only when finish() is called

    @property
    def gradient_order(self) -> list[int] | None:
        """minddp's learned launch order (bucketed, individual), for checkpoints; else None."""
        return self.wrapper.gradient_order if self.kind in MINDDP_HOOKED else None

    def set_gradient_order(self, order: list[int] | None) -> None:
        """Launch along a checkpoint's ``gradient_order`` (ignored by the other kinds), so
        that a resumed run cuts and sums its buckets as the interrupted one did."""
        if order is not None and self.kind in MINDDP_HOOKED:
            self.wrapper.set_gradient_order(order)

    def finish(self) -> None:
        """Leave averaged gradients on every rank (after the last backward of a step)."""
        if self.kind in MINDDP_HOOKED:
            self.wrapper.finish_gradient_synchronization()
        elif self.kind in ("flat", "naive") and dist.get_world_size() > 1:
            from minddp import all_reduce_gradients

            all_reduce_gradients(self.model, flat=self.kind == "flat")
        # "torch" has finished inside backward; "none" has nothing to do.


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


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: matrices and embeddings decay, vectors (norm weights, biases) do not."""
    decay, no_decay = [], []
    for p in model.parameters():  # tied weights come once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


#: zero1's ShardedOptimizer stage of the kinds it reduces gradients for itself.
ZERO_STAGES = {"zero1": 1, "zero2": 2}


def build_optimizer(model: nn.Module, sharding: str, *, lr: float, betas: tuple[float, float],
                    weight_decay: float, fused: bool = False, bucket_mb: float = 25.0,
                    bucket_rule: str = "reach") -> torch.optim.Optimizer:
    """AdamW over ``model``'s parameters, sharded as asked.

    Args:
        model: the bare model (for "fsdp", after ``fully_shard``: its parameters are the
            sharded DTensors).
        sharding: one of ``settings.SHARDING_KINDS``.
        lr, betas, weight_decay: AdamW's hyperparameters.
        fused: AdamW's fused kernels (one launch per step for all its tensors; CUDA).
        bucket_mb, bucket_rule: the gradient buckets of "zero1" and "zero2".
    """
    groups = param_groups(model, weight_decay)
    kwargs: dict[str, Any] = dict(lr=lr, betas=betas, eps=1e-8)
    if fused:
        kwargs["fused"] = True
    if sharding in ("none", "fsdp"):
        return torch.optim.AdamW(groups, **kwargs)
    if sharding in ZERO_STAGES:
        from zero1 import ShardedOptimizer

        return ShardedOptimizer(groups, torch.optim.AdamW, stage=ZERO_STAGES[sharding],
                                reduce_gradients=True, bucket_size_mb=bucket_mb,
                                bucket_rule=bucket_rule, **kwargs)
    if sharding == "zero1-allreduce":
        from zero1 import ShardedOptimizer

        return ShardedOptimizer(groups, torch.optim.AdamW, reduce_gradients=False, **kwargs)
    if sharding == "torch":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **kwargs)
    raise ValueError(f"unknown sharding {sharding!r}")


def fused_adamw_available(device: torch.device) -> bool:
    """Whether the trainer steps AdamW with its fused kernels on ``device``: on CUDA. The
    CPU has them too (torch >= 2.4), but CPU runs are tests and demos, which keep the
    default arithmetic their oracles use."""
    return device.type == "cuda"


def full_optimizer_state(optimizer: torch.optim.Optimizer, rank: int) -> dict | None:
    """The whole optimizer state in AdamW's format on rank 0, None elsewhere (not for
    "fsdp": see :meth:`Parallel.full_optimizer_state`).

    A collective for sharded optimizers: call it on every rank.
    """
    if hasattr(optimizer, "consolidate_state_dict"):
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if rank == 0 else None
    return optimizer.state_dict() if rank == 0 else None


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a whole (consolidated) state into any of the non-FSDP optimizers, on every rank."""
    # ZeroRedundancyOptimizer edits the dict it is given; hand it a copy.
    state = {"state": dict(state["state"]),
             "param_groups": [dict(g) for g in state["param_groups"]]}
    optimizer.load_state_dict(state)


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


class Parallel:
    """A model set up for training by :func:`parallelize`: what the training step calls.

    Attributes:
        model: the bare model (with "fsdp" its parameters are sharded DTensors).
        sharding, ddp: the kinds (``--sharding``, ``--ddp``).
        sync: the DDP wrapper's ``GradSync`` (kind "none" with zero1, zero2 and fsdp).
        optimizer: steps the parameters.
        eval_module: what evaluation forwards through (no DDP wrapper; compiled when the
            run compiles; the FSDP root with "fsdp", so every rank must evaluate).
    """

    def __init__(self, model: nn.Module, sharding: str, ddp: str, sync: GradSync,
                 optimizer: torch.optim.Optimizer, eval_module: nn.Module) -> None:
        self.model = model
        self.sharding = sharding
        self.ddp = ddp
        self.sync = sync
        self.optimizer = optimizer
        self.eval_module = eval_module

    @property
    def zero_reduces(self) -> bool:
        """Whether zero1's ShardedOptimizer averages the gradients (zero1, zero2)."""
        return self.sharding in ZERO_STAGES

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The training forward (through the DDP wrapper, if any)."""
        return self.sync(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, with no communication (all micro-batches but the
        last of a step)."""
        if self.zero_reduces:
            with self.optimizer.no_sync():
                yield
        elif self.sharding == "fsdp":
            self.model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.model.set_requires_gradient_sync(True)
        else:
            with self.sync.no_sync():
                yield

    def finish(self) -> None:
        """Wait for or perform the gradient averaging (after a step's last backward)."""
        if self.zero_reduces:
            self.optimizer.finish_gradient_synchronization()
        elif self.sharding != "fsdp":  # FSDP2 waits inside backward
            self.sync.finish()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the averaged gradients to a global 2-norm of ``max_norm`` (``inf``: only
        measure it); returns the norm before clipping, a plain tensor on every rank. A
        collective for zero1, zero2 (``ShardedOptimizer.clip_grad_norm_``: model grads are
        not the averaged ones there) and fsdp (the gradients are sharded DTensors)."""
        if self.zero_reduces:
            return self.optimizer.clip_grad_norm_(max_norm, norm_type=2.0)
        params = [p for p in self.model.parameters() if p.grad is not None]
        return _full_tensor(torch.nn.utils.clip_grad_norm_(params, max_norm))

    @property
    def gradient_order(self) -> list[int] | None:
        """The learned bucket order, for checkpoints: minddp's launch order
        (``GradSync``'s), or with zero1 and zero2 the order ShardedOptimizer's buckets
        follow after the first step; None for the other kinds."""
        if self.zero_reduces:
            return self.optimizer.gradient_order
        return self.sync.gradient_order

    def set_gradient_order(self, order: list[int] | None) -> None:
        """Follow a checkpoint's order (a collective with zero1 and zero2)."""
        if self.zero_reduces:
            self.optimizer.set_gradient_order(order)
        else:
            self.sync.set_gradient_order(order)

    # ----------------------------------------------------------------- checkpoints
    def full_model_state(self, rank: int) -> dict[str, torch.Tensor] | None:
        """The model's whole state dict (CPU tensors with "fsdp") on rank 0, None
        elsewhere. A collective with "fsdp": call it on every rank."""
        if self.sharding == "fsdp":
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            state = get_model_state_dict(self.model, options=_full_options(cpu_offload=True))
            return state if rank == 0 else None
        return self.model.state_dict() if rank == 0 else None

    def full_optimizer_state(self, rank: int) -> dict | None:
        """The whole optimizer state in plain AdamW's format (state keyed by parameter
        number, in ``param_groups``' order) on rank 0, None elsewhere; loadable by any
        kind at any world size. A collective: call it on every rank."""
        if self.sharding != "fsdp":
            return full_optimizer_state(self.optimizer, rank)
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
        if self.sharding != "fsdp":
            load_full_optimizer_state(self.optimizer, state)
            return
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


def parallelize(model: nn.Module, *, sharding: str, ddp: str, device: torch.device,
                lr: float, betas: tuple[float, float], weight_decay: float,
                fused: bool = False, compile: dict[str, Any] | None = None,
                forward: nn.Module | None = None, bucket_mb: float = 25.0,
                bucket_rule: str = "reach", reduce_dtype: torch.dtype | None = None,
                reshard_after_forward: bool = True) -> Parallel:
    """Set ``model`` up for training: the one place that applies parallelism, in a fixed
    order.

    1. Compilation: with ``compile`` (:func:`compile_model`'s arguments), the bare model
       is compiled block by block, or whole; everything after wraps or hooks the bare
       model's modules and parameters, so the DDP wrappers' and zero1's gradient hooks
       and FSDP2's module hooks still fire around the compiled graphs.
    2. Data parallelism / sharding:
       - "zero1", "zero2", "fsdp": no DDP wrapper; the ranks' models are checked to agree
         (``minddp.check_model_consistency``) and rank 0's parameters and buffers are
         broadcast (``minddp.broadcast_module``), then for "fsdp" ``fully_shard`` is
         applied to every transformer block and then the root;
       - the others: the ``--ddp`` wrapper (``GradSync``) around the forward module.
    3. The optimizer (:func:`build_optimizer`): for "zero1"/"zero2" it registers its
       gradient hooks on the parameters, for "fsdp" it is plain AdamW over the shards.

    Args:
        model: the bare model, on ``device``, identical on every rank.
        sharding: one of ``settings.SHARDING_KINDS``.
        ddp: one of ``settings.DDP_KINDS`` ("none" with zero1, zero2 and fsdp).
        device: this rank's device.
        lr, betas, weight_decay, fused: AdamW's.
        compile: torch.compile's backend and mode and the scope (:func:`compile_model`),
            or None.
        forward: an already wrapped forward module (the bench's, when it compiles itself);
            exclusive with ``compile``.
        bucket_mb, bucket_rule: DDP's buckets and zero1/zero2's.
        reduce_dtype: the DDP wrapper's wire dtype (``GradSync``).
        reshard_after_forward: FSDP2's, for "fsdp".
    """
    from lab2_trainer.config import SELF_REDUCING

    if sharding in SELF_REDUCING and ddp != "none":
        raise ValueError(f"sharding {sharding!r} averages gradients itself: ddp must be "
                         f"'none', not {ddp!r}")
    # 1. Compilation of the bare model.
    forward_module = model if forward is None else forward
    if compile is not None:
        forward_module = compile_model(model, **compile)
    # 2. Data parallelism / sharding.
    if sharding in SELF_REDUCING:
        if dist.is_available() and dist.is_initialized():
            from minddp import broadcast_module, check_model_consistency

            check_model_consistency(model)
            broadcast_module(model)
        if sharding == "fsdp":
            _fully_shard(model, device, reshard_after_forward)
    sync = GradSync(model, forward_module, ddp, bucket_mb, device, reduce_dtype=reduce_dtype,
                    bucket_rule=bucket_rule)
    # 3. The optimizer.
    optimizer = build_optimizer(model, sharding, lr=lr, betas=betas, weight_decay=weight_decay,
                                fused=fused, bucket_mb=bucket_mb, bucket_rule=bucket_rule)
    return Parallel(model, sharding, ddp, sync, optimizer, eval_module=forward_module)


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


def _fully_shard(model: nn.Module, device: torch.device, reshard_after_forward: bool) -> None:
    """FSDP2 over the ranks of the default group: each transformer block (``model.blocks``)
    is a unit of its own, the root holds the rest (embeddings, final norm, head)."""
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard = fully_shard_fn()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in getattr(model, "blocks", ()):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
