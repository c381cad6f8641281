"""The timed units of the single-process suites (forward, forward+backward, training step),
and the AdamW every suite steps: the trainer's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lab2_trainer.bench.arguments import MODES
from lab2_trainer.bench.workload import autocast
from lab2_trainer.config import TrainSettings
from lab2_trainer.parallel import build_optimizer, fused_adamw_available
from lab2_trainer.train import backward_thread as backward_on

#: The learning rate every suite steps AdamW with.
LR = 1e-4


def make_optimizer(model: nn.Module, sharding: str = "none", *,
                   lr: float = LR) -> torch.optim.Optimizer:
    """The trainer's AdamW (``parallel.build_optimizer``), as every suite steps it: decay and
    no-decay parameter groups, the trainer's default betas and weight decay, fused kernels
    on CUDA (``fused_adamw_available``); sharded as ``sharding`` says ("none", "zero1" or
    "torch", a collective to build on every rank)."""
    defaults = TrainSettings()
    device = next(model.parameters()).device
    return build_optimizer(model, sharding, lr=lr, betas=(defaults.beta1, defaults.beta2),
                           weight_decay=defaults.weight_decay,
                           fused=fused_adamw_available(device))


def make_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], *, mode: str,
              precision: str, device: torch.device,
              optimizer: torch.optim.Optimizer | None = None,
              backward_thread: str = "caller") -> Callable[[], Any]:
    """A no-argument callable running one unit of work on ``batch``.

    Args:
        model: a model whose ``forward(idx, targets)`` returns ``(logits, loss)``.
        batch: (inputs, targets).
        mode: "forward" (the forward of a training step, autograd recording, loss included),
            "forward_backward" (gradients set to None, forward, backward) or "train_step"
            (that plus ``optimizer.step()``; fp16 uses a gradient scaler on CUDA).
        precision: "fp32", "bf16" or "fp16" (autocast).
        device: where the model is.
        optimizer: required for "train_step".
        backward_thread: the thread that runs backward ("caller", as the trainer does, or
            "autograd"; see ``lab2_trainer.train``).
    """
    idx, tgt = batch
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")

    def loss_of() -> torch.Tensor:
        with autocast(precision, device):
            _, loss = model(idx, tgt)
        return loss

    if mode == "forward":
        return loss_of
    if mode == "forward_backward":
        def forward_backward() -> None:
            model.zero_grad(set_to_none=True)
            loss = loss_of()
            with backward_on(backward_thread):
                loss.backward()
        return forward_backward
    if optimizer is None:
        raise ValueError("mode 'train_step' needs an optimizer")
    scaler = None
    if precision == "fp16" and device.type == "cuda":
        scaler = torch.amp.GradScaler("cuda")

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of()
        with backward_on(backward_thread):
            (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
    return train_step


def time_modes(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], *,
               modes: list[str], precision: str, device: torch.device, warmup: int,
               steps: int, backward_thread: str = "caller") -> dict[str, Any]:
    """``lab2bench.measure`` of each mode; returns ``{mode: Stats}``."""
    from lab2bench import measure

    optimizer = make_optimizer(model) if "train_step" in modes else None
    out = {}
    for mode in modes:
        fn = make_step(model, batch, mode=mode, precision=precision, device=device,
                       optimizer=optimizer, backward_thread=backward_thread)
        out[mode] = measure(fn, warmup=warmup, repeats=steps, device=device)
    model.zero_grad(set_to_none=True)
    return out


def stats_metrics(stats: Any, tokens: int) -> dict[str, float]:
    """Mean/std/median in ms and tokens per second of one ``Stats``."""
    return {
        "mean_ms": stats.mean * 1e3,
        "std_ms": stats.std * 1e3,
        "median_ms": stats.median * 1e3,
        "tokens_per_s": tokens / stats.mean if stats.mean > 0 else float("nan"),
        "samples_ms": [s * 1e3 for s in stats.samples],
    }
