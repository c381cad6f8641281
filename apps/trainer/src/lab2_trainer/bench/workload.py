"""What every suite measures on: the model of a preset, random token batches, precision,
and small helpers for timing steps by hand and accounting tensor bytes.

``micro`` is a bench-only pseudo-preset (2 layers of width 32) so that every suite's
``--quick`` form runs on the CPU in seconds.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from lab2_trainer.config import PRECISIONS as _PRECISION_NAMES
from lab2_trainer.config import ModelConfig, model_config

#: The micro model of ``--quick`` runs (a bench-only name next to the trainer's presets).
MICRO = dict(d_model=32, d_ff=64, n_layers=2, n_heads=2, context_length=32)
#: The trainer's precision table, as dtypes (float32 for "fp32", which runs no autocast).
PRECISIONS = {name: getattr(torch, dtype or "float32") for name, dtype in _PRECISION_NAMES.items()}


def build_config(preset: str, *, context_length: int, vocab_size: int | None = None,
                 norm: str | None = None, overrides: dict[str, Any] | None = None) -> ModelConfig:
    """The model configuration of ``preset`` with the benchmark's context length.

    Args:
        preset: a trainer preset or ``micro``.
        context_length: sequence length of the benchmark batches (also the model's).
        vocab_size: override of the preset's vocabulary (None keeps it).
        norm: norm layer kind (None keeps the preset's default).
        overrides: more ``ModelConfig`` fields (``--set n_layers=4``).
    """
    fields = {**(overrides or {}), "context_length": context_length, "vocab_size": vocab_size,
              "norm": norm}
    if preset == "micro":
        return model_config("tiny", **{**MICRO, **fields})
    return model_config(preset, **fields)


def build_model(config: ModelConfig, device: torch.device | str, *, seed: int = 0) -> nn.Module:
    """``TransformerLM(config)`` initialised from ``seed`` on ``device``, in training mode."""
    from lab2_trainer.model import TransformerLM

    return TransformerLM(config, seed=seed, device=torch.device(device)).train()


def random_batch(config: ModelConfig, batch_size: int, device: torch.device | str, *,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random (inputs, next-token targets) batch of shape (batch_size, context_length).

    Drawn from its own generator on the CPU, so every process and device gets the same
    tokens for the same seed.
    """
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (batch_size, config.context_length + 1),
                           generator=gen)
    tokens = tokens.to(device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def autocast(precision: str, device: torch.device | str) -> contextlib.AbstractContextManager:
    """Autocast to ``precision`` ("fp32" means no autocast) on ``device``'s type."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=PRECISIONS[precision])


def free_memory(device: torch.device | str) -> None:
    """Drop garbage and, on CUDA, the allocator's cached blocks, between variants."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


class StepMarks:
    """Timestamps at named points of one step: CUDA events on the current stream on GPU
    (device time, no synchronisation inside the step, so overlap is not disturbed), wall
    time on the CPU.

    Call ``mark(name)`` at each point, then ``durations()`` once the step is over: the time
    from the first mark to each later one, in seconds.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.device = device
        self.points: list[tuple[str, Any]] = []

    def mark(self, name: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.points.append((name, ev))
        else:
            self.points.append((name, time.perf_counter()))

    def durations(self) -> dict[str, float]:
        if not self.points:
            return {}
        if self.cuda:
            torch.cuda.synchronize(self.device)
            first = self.points[0][1]
            return {n: first.elapsed_time(ev) / 1e3 for n, ev in self.points[1:]}
        t0 = self.points[0][1]
        return {n: t - t0 for n, t in self.points[1:]}


def unique_tensors(tensors: Iterable[Any]) -> Iterator[torch.Tensor]:
    """Each distinct tensor storage once (views of one buffer counted once)."""
    seen: set[tuple[str, int]] = set()
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        try:
            key = (str(t.device), t.untyped_storage().data_ptr())
        except (RuntimeError, AttributeError):
            key = (str(t.device), id(t))
        if key in seen:
            continue
        seen.add(key)
        yield t


def storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view costs nothing extra)."""
    return sum(t.untyped_storage().nbytes() for t in unique_tensors(tensors))


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the state this rank's optimizer holds, wherever a wrapper keeps it:
    ``optimizer.state`` and the state of any ``torch.optim.Optimizer`` it wraps (e.g.
    ``ZeroRedundancyOptimizer.optim``)."""
    found: list[torch.Tensor] = []
    holders = [optimizer]
    for value in vars(optimizer).values():
        if isinstance(value, torch.optim.Optimizer) and value is not optimizer:
            holders.append(value)
    for holder in holders:
        for per_param in holder.state.values():
            if isinstance(per_param, dict):
                found.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
    return found


def tensor_breakdown(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state, counted from the tensors."""
    params = list(model.parameters())
    return {
        "param_bytes": storage_bytes(params),
        "grad_bytes": storage_bytes(p.grad for p in params if p.grad is not None),
        "optim_state_bytes": (storage_bytes(optimizer_state_tensors(optimizer))
                              if optimizer is not None else 0),
    }


def current_rss_bytes() -> int:
    """Resident set of this process now (Linux /proc; 0 where unavailable)."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def memory_now(device: torch.device | str) -> int:
    """Allocated bytes now: the CUDA allocator's count on GPU, the resident set on the CPU."""
    if torch.device(device).type == "cuda":
        return torch.cuda.memory_allocated(device)
    return current_rss_bytes()


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
