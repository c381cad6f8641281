"""Shared machinery of the multi-rank suites (``ddp``, ``zero``, ``stack``).

Every rank builds the same model from the same seed, then measures each variant in turn,
``rounds`` times over with the order rotated each round, so slow drifts of a shared machine
(another job starting, thermal limits) fall on every variant alike instead of on whichever
ran last. A variant is rebuilt from a CPU copy of the initial model each time it runs, so all
variants start from identical parameters and see identical batches, and only one variant's
parameters, gradients and optimizer state are alive at once. A variant is set up by the
trainer's own code (``lab2_trainer.parallel``: ``GradSync`` and ``build_optimizer``), so
what is measured is what trains.

Each step is timed at named points with ``StepMarks``: CUDA events on the compute stream
on GPU (nothing inside the step synchronises, so overlap is left intact), wall time on the
CPU. ``--timing throughput`` (the default) runs the timed steps back to back, as a training
loop does, and reads the events once they are over: a step lasts from the GPU reaching its
first event to it reaching its last, so tokens/s is a training run's. ``--timing latency``
starts each step after a barrier and reads its events at once, which drains the GPU's
queue: a step's host time is then never hidden behind the previous step's kernels.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lab2_trainer.bench.arguments import SHARDINGS
from lab2_trainer.bench.steps import LR, make_optimizer
from lab2_trainer.bench.workload import (
    StepMarks,
    autocast,
    build_config,
    build_model,
    free_memory,
    random_batch,
)
from lab2_trainer.config import TrainSettings
from lab2_trainer.parallel import GradSync, fused_adamw_available
from lab2_trainer.train import backward_thread as backward_on

#: The points of a step, in order; durations are measured from the step's start.
POINTS = ("forward", "backward", "sync", "optimizer")


@dataclass
class RankSpec:
    """Settings every rank receives (picklable)."""

    preset: str
    context_length: int
    batch_size: int
    vocab_size: int | None
    norm: str | None
    precision: str
    seed: int
    warmup: int
    steps: int
    rounds: int
    variants: list[str]
    overrides: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    back_to_back: bool = True
    backward_thread: str = "caller"


@dataclass
class Variant:
    """One way of training, ready to step, built as the trainer builds it (:func:`make_variant`).

    Attributes:
        model: the bare model (its parameters, gradients and state are accounted).
        sync: the trainer's ``GradSync``: the forward goes through it (``sync(idx, tgt)``),
            and ``sync.finish()`` after backward waits for or performs the averaging.
        optimizer: steps the parameters (the trainer's AdamW, ``steps.make_optimizer``).
    """

    model: nn.Module
    sync: GradSync
    optimizer: torch.optim.Optimizer


def make_variant(model: nn.Module, ddp: str, sharding: str, device: torch.device, *,
                 forward: nn.Module | None = None, bucket_mb: float = 25.0,
                 reduce_dtype: torch.dtype | None = None, bucket_rule: str = "reach") -> Variant:
    """``model`` set up for training as the trainer sets it up: ``GradSync`` of kind ``ddp``
    around ``forward`` (default the model; its compiled form with ``--compile``), then the
    trainer's AdamW sharded as ``sharding`` says.

    Args:
        bucket_mb: bucket size of "bucketed" and "torch" (default 25, PyTorch DDP's).
        reduce_dtype: the dtype gradients travel in (``GradSync``'s).
        bucket_rule: how ``bucket_mb`` cuts "bucketed"'s buckets (``GradSync``'s).
    """
    from lab2_trainer.config import SELF_REDUCING

    if sharding in SELF_REDUCING:
        raise ValueError(f"sharding {sharding!r} averages gradients itself: build it with "
                         "make_sharded_variant")
    sync = GradSync(model, model if forward is None else forward, ddp, bucket_mb, device,
                    reduce_dtype=reduce_dtype, bucket_rule=bucket_rule)
    return Variant(model, sync, make_optimizer(model, sharding))


def make_sharded_variant(model: nn.Module, kind: str, device: torch.device, *,
                         compile: dict[str, Any] | None = None, bucket_mb: float = 25.0,
                         bucket_rule: str = "reach", ddp: str | None = None) -> Variant:
    """``model`` set up as the trainer sets up ``--sharding`` of ``SHARDINGS[kind]``, by the
    trainer's own ``parallelize`` (compilation, wrapper or sharding, then AdamW); ``ddp``
    replaces the kind's DDP wrapper where it has one."""
    from lab2_trainer.parallel import parallelize

    sharding, kind_ddp, reshard = SHARDINGS[kind]
    if ddp is not None and kind_ddp != "none":
        kind_ddp = ddp
    defaults = TrainSettings()
    p = parallelize(model, sharding=sharding, ddp=kind_ddp, device=device, lr=LR,
                    betas=(defaults.beta1, defaults.beta2), weight_decay=defaults.weight_decay,
                    fused=fused_adamw_available(device), compile=compile, bucket_mb=bucket_mb,
                    bucket_rule=bucket_rule, reshard_after_forward=reshard)
    return Variant(p.model, p, p.optimizer)  # a Parallel steps as a GradSync does


def held_bytes(v: Variant) -> dict[str, int]:
    """Bytes of gradients and optimizer state this rank holds now, counted from the tensors
    (local shards of DTensors; zero1's own gradient buffers; each storage once)."""
    from lab2_trainer.bench.workload import optimizer_state_tensors, storage_bytes

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    if hasattr(v.optimizer, "gradient_bytes"):
        grads = v.optimizer.gradient_bytes()
    else:
        grads = storage_bytes(local(p.grad) for p in v.model.parameters() if p.grad is not None)
    state = storage_bytes(local(t) for t in optimizer_state_tensors(v.optimizer))
    return {"grad_bytes": grads, "optim_state_bytes": state}


def rank_spec(args: argparse.Namespace, preset: str, variants: list[str],
              **extra: Any) -> RankSpec:
    if args.rounds < 1:
        raise SystemExit("lab2-train bench: --rounds must be >= 1")
    return RankSpec(preset=preset, context_length=args.context_length,
                    batch_size=args.batch_size, vocab_size=args.vocab_size, norm=args.norm,
                    precision=args.precision, seed=args.seed, warmup=args.warmup,
                    steps=args.steps, rounds=args.rounds, variants=variants,
                    overrides=dict(args.overrides), extra=extra,
                    back_to_back=_throughput(args), backward_thread=args.backward_thread)


def _throughput(args: argparse.Namespace) -> bool:
    return getattr(args, "timing", "throughput") == "throughput"


def timing_label(args: argparse.Namespace) -> str:
    """How the steps were timed, for records and titles (see the module docstring)."""
    return "back to back" if _throughput(args) else "after a barrier"


def thread_label(args: argparse.Namespace) -> str:
    """Which thread ran backward, for titles (``--backward-thread``)."""
    return f"backward on the {args.backward_thread} thread"


def launch(fn: Callable[..., Any], args: argparse.Namespace, spec: RankSpec) -> list[Any]:
    """Spawn ``args.world_size`` ranks running ``fn(rank, world_size, spec)``."""
    from lab2_trainer.bench.launcher import RankError, spawn_ranks

    device = "cuda" if args.device.startswith("cuda") else "cpu"
    try:
        return spawn_ranks(fn, args.world_size, spec, device=device, timeout=args.timeout,
                           threads=args.threads)
    except (RankError, ValueError) as err:
        raise SystemExit(f"lab2-train bench {args.suite}: {err}") from None


def rank_device() -> torch.device:
    """This rank's device: its GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def base_model(spec: RankSpec, *, norm: str | None = None) -> nn.Module:
    """The initial model, on the CPU (copied to the device per variant)."""
    config = build_config(spec.preset, context_length=spec.context_length,
                          vocab_size=spec.vocab_size, norm=norm or spec.norm,
                          overrides=spec.overrides)
    return build_model(config, "cpu", seed=spec.seed)


def rank_batches(model: nn.Module, spec: RankSpec, rank: int, device: torch.device,
                 count: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A few batches of this rank's own slice of the data (cycled over the steps)."""
    return [random_batch(model.config, spec.batch_size, device,
                         seed=spec.seed * 1_000_003 + rank * 1009 + i) for i in range(count)]


def fresh_copy(base: nn.Module, device: torch.device) -> nn.Module:
    """A copy of ``base`` on ``device`` (identical parameters on every rank and variant)."""
    return copy.deepcopy(base).to(device)


def run_step(v: Variant, batch: tuple[torch.Tensor, torch.Tensor], precision: str,
             device: torch.device, backward_thread: str = "caller") -> dict[str, float]:
    """One training step, timed at every point of :data:`POINTS` (seconds from its start)."""
    return step_marks(v, batch, precision, device, backward_thread).durations()


def step_marks(v: Variant, batch: tuple[torch.Tensor, torch.Tensor], precision: str,
               device: torch.device, backward_thread: str = "caller") -> StepMarks:
    """One training step, marked at every point of :data:`POINTS`; read the marks later.
    ``backward_thread`` is the trainer's setting of that name."""
    idx, tgt = batch
    marks = StepMarks(device)
    marks.mark("start")
    v.optimizer.zero_grad(set_to_none=True)
    with autocast(precision, device):
        _, loss = v.sync(idx, tgt)
    marks.mark("forward")
    with backward_on(backward_thread):
        loss.backward()
    marks.mark("backward")
    v.sync.finish()
    marks.mark("sync")
    v.optimizer.step()
    marks.mark("optimizer")
    return marks


def measure_variants(
    rank: int,
    spec: RankSpec,
    build: Callable[[str], Variant],
    batches_for: Callable[[str], list],
    *,
    after_variant: Callable[[str, Variant, int], None] | None = None,
    on_first_step: Callable[[str, Variant], dict] | None = None,
) -> dict[str, dict[str, Any]]:
    """Run every variant ``spec.rounds`` times (rotated order) and collect step timings.

    Args:
        rank: this rank.
        spec: the suite's settings.
        build: makes a fresh ``Variant`` by name.
        batches_for: this rank's batches for a variant (cycled over the steps).
        after_variant: called with (name, variant, round) after a variant's timed steps
            (e.g. to take a profiler trace), before it is freed.
        on_first_step: if given, runs the first warm-up step of each variant's first round
            instead of ``run_step`` (e.g. with memory measurement); gets (name, variant) and
            returns a dict kept under ``"first_step"``.

    Returns:
        ``{variant: {"steps": [durations per timed step], "first_step": {...}}}``.
    """
    device = rank_device()
    results: dict[str, dict[str, Any]] = {name: {"steps": []} for name in spec.variants}
    for rnd in range(spec.rounds):
        shift = rnd % len(spec.variants)
        order = spec.variants[shift:] + spec.variants[:shift]
        for name in order:
            t0 = time.perf_counter()
            free_memory(device)
            v = build(name)
            batches = batches_for(name)
            timed: list[StepMarks] = []
            thread = spec.backward_thread
            for i in range(spec.warmup + spec.steps):
                batch = batches[i % len(batches)]
                if not spec.back_to_back or i <= spec.warmup:  # timed steps start together
                    dist.barrier()
                if i == 0 and on_first_step is not None and rnd == 0:
                    results[name]["first_step"] = on_first_step(name, v)
                    continue
                if i < spec.warmup:
                    run_step(v, batch, spec.precision, device, thread)
                elif spec.back_to_back:
                    timed.append(step_marks(v, batch, spec.precision, device, thread))
                else:
                    steps = results[name]["steps"]
                    steps.append(run_step(v, batch, spec.precision, device, thread))
            results[name]["steps"] += [marks.durations() for marks in timed]
            if after_variant is not None:
                after_variant(name, v, rnd)
            del v
            free_memory(device)
            if rank == 0:
                print(f"  [rank 0] round {rnd + 1}/{spec.rounds} {name}: "
                      f"{time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    return results


def summarize(per_rank: list[dict[str, dict[str, Any]]], variant: str) -> dict[str, float]:
    """Combine the ranks' timings of one variant.

    The step time of a step is the slowest rank's (the step is over when every rank is);
    the phases (forward, backward, sync wait, optimizer) are averaged over ranks and steps.
    """
    from lab2bench import Stats

    runs = [r[variant]["steps"] for r in per_rank]
    n = min(len(s) for s in runs)
    if n == 0:
        raise ValueError(f"variant {variant}: no timed steps (need --steps >= 1)")
    step = Stats.from_samples([max(run[i]["optimizer"] for run in runs) for i in range(n)])

    def phase(a: str | None, b: str) -> float:
        vals = [s[b] - (s[a] if a else 0.0) for run in runs for s in run[:n]]
        return statistics.fmean(vals)

    return {
        "step_ms": step.mean * 1e3,
        "step_std_ms": step.std * 1e3,
        "step_median_ms": step.median * 1e3,
        "forward_ms": phase(None, "forward") * 1e3,
        "backward_ms": phase("forward", "backward") * 1e3,
        "sync_wait_ms": phase("backward", "sync") * 1e3,
        "optimizer_ms": phase("sync", "optimizer") * 1e3,
        "n_steps": n,
        "step_samples_ms": [s * 1e3 for s in step.samples],
    }
