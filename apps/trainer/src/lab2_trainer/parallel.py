"""The data-parallel and optimizer choices of a run, behind two small interfaces.

:class:`GradSync` hides which gradient averaging is used (minddp's four, PyTorch's
DistributedDataParallel, or none) behind ``forward``, ``no_sync()`` and ``finish()``;
:func:`build_optimizer` builds AdamW plain, sharded by zero1, or sharded by PyTorch's
ZeroRedundancyOptimizer, and :func:`full_optimizer_state` returns its whole state on
rank 0 whichever it is.
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


def build_optimizer(model: nn.Module, sharding: str, *, lr: float, betas: tuple[float, float],
                    weight_decay: float, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW over ``model``'s parameters, sharded as asked.

    Args:
        model: the bare model.
        sharding: "none", "zero1" or "torch".
        lr, betas, weight_decay: AdamW's hyperparameters.
        fused: AdamW's fused kernels (one launch per step for all its tensors; CUDA).
    """
    groups = param_groups(model, weight_decay)
    kwargs: dict[str, Any] = dict(lr=lr, betas=betas, eps=1e-8)
    if fused:
        kwargs["fused"] = True
    if sharding == "none":
        return torch.optim.AdamW(groups, **kwargs)
    if sharding == "zero1":
        from zero1 import ShardedOptimizer

        return ShardedOptimizer(groups, torch.optim.AdamW, **kwargs)
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
    """The whole optimizer state in AdamW's format on rank 0, None elsewhere.

    A collective for sharded optimizers: call it on every rank.
    """
    if hasattr(optimizer, "consolidate_state_dict"):
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if rank == 0 else None
    return optimizer.state_dict() if rank == 0 else None


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a whole (consolidated) state into any of the three optimizers, on every rank."""
    # ZeroRedundancyOptimizer edits the dict it is given; hand it a copy.
    state = {"state": dict(state["state"]),
             "param_groups": [dict(g) for g in state["param_groups"]]}
    optimizer.load_state_dict(state)
