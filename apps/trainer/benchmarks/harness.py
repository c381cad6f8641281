"""What the trainer's benchmark scripts share: their common options, the model and batches
they measure on, the trainer's own set-up and step (``step.train_step``, timed at named
points), N local ranks measuring variants in interleaved rounds, and where the rows go.

Every script steps the trainer's AdamW (decay and no-decay groups, the default betas and
weight decay, fused kernels on CUDA), and those that wrap or shard the model set it up with
the trainer's own ``parallelize`` (:func:`setup`), so what is measured is what trains.
``micro`` is a bench-only preset (2 layers of width 32): every script's ``--quick`` runs it
on the CPU in seconds.

Multi-rank scripts (``ddp.py``, ``zero.py``, ``stack.py``) start N ranks with
``lab2bench.ranks.spawn_ranks`` (Gloo on the CPU, NCCL with one GPU per rank; a deadline,
``--timeout``, ends a hung run). Every rank builds the same model from the same seed, then
measures each variant ``--rounds`` times with the order rotated each round, so a slow spell
of a shared machine falls on every variant alike. A variant is rebuilt from a CPU copy of
the initial model each time, so only one variant's state is alive at once. ``--timing
throughput`` (the default) runs the timed steps back to back and reads their CUDA events at
the end, as a training loop does; ``--timing latency`` starts each step after a barrier.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lab2_trainer.config import (
    BACKWARD_THREADS,
    PRECISIONS,
    PRESETS,
    ModelConfig,
    TrainSettings,
    model_config,
)
from lab2_trainer.parallel.parallelize import (
    Parallel,
    build_optimizer,
    fused_adamw_available,
    parallelize,
)
from lab2_trainer.reporting.report import device_label, device_peak
from lab2_trainer.training.step import backward_thread as backward_on
from lab2_trainer.training.step import train_step

#: The micro model of ``--quick`` runs.
MICRO = dict(d_model=32, d_ff=64, n_layers=2, n_heads=2, context_length=32)
#: What ``--quick`` sets for every option not given, and the defaults otherwise.
QUICK = dict(device="cpu", presets=["micro"], batch_size=2, context_length=16, warmup=1,
             steps=2, rounds=1)
FULL = dict(device="auto", presets=["small"], batch_size=4, context_length=256, warmup=5,
            steps=10, rounds=3)
#: The units a single-device script times.
MODES = ("forward", "forward_backward", "train_step")
#: The learning rate every variant steps AdamW with.
LR = 1e-4
#: The gradient-norm clip every step applies: the trainer's default.
CLIP = TrainSettings().clip
#: Every way of sharding ``zero.py`` and ``stack.py`` compare, by name: (the trainer's
#: ``--sharding``, its ``--ddp``, FSDP2's ``reshard_after_forward``).
SHARDINGS: dict[str, tuple[str, str, bool]] = {
    "adamw": ("none", "torch", True),
    "zero1": ("zero1", "none", True),
    "zero2": ("zero2", "none", True),
    "zero1-allreduce": ("zero1-allreduce", "torch", True),
    "torch_zero": ("torch", "torch", True),
    "zero3": ("zero3", "none", True),
    "zero3-keep": ("zero3", "none", False),
    "fsdp": ("fsdp", "none", True),
    "fsdp-keep": ("fsdp", "none", False),
}
#: The precisions a script takes by name: autocast alone. fp8 also converts the blocks
#: (``parallelize``'s ``float8``): ``fp8_throughput.py`` measures it.
AUTOCAST_PRECISIONS = [name for name in PRECISIONS if name != "fp8"]
#: The points of a step, in order.
POINTS = ("forward", "backward", "sync", "optimizer")
MIB = 2**20


def split(text: str) -> list[str]:
    return text.split(",")


def parser(description: str, *, ranks: bool = False,
           rounds: bool = True) -> argparse.ArgumentParser:
    """The options every script takes; with ``ranks``, those of the multi-rank ones; with
    ``rounds``, ``--rounds`` (variants measured in interleaved rounds)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true",
                   help="micro model on the CPU, done in seconds (a smoke test)")
    p.add_argument("--out", default=None, help="write NAME.jsonl (appended), NAME.md, PNGs")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N or auto")
    p.add_argument("--preset", dest="presets", type=split, default=None,
                   help=f"comma-separated: micro, {', '.join(PRESETS)}")
    p.add_argument("--precision", default="fp32", choices=AUTOCAST_PRECISIONS)
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (per rank)")
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--norm", default=None, help="the model's norm layer")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first")
    p.add_argument("--steps", type=int, default=None, help="timed steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backward-thread", default="caller", choices=list(BACKWARD_THREADS))
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (per rank; default 1 with --quick)")
    if rounds:
        p.add_argument("--rounds", type=int, default=None,
                       help="measure every variant this many times, order rotated each "
                            "round (default 3; 1 with --quick)")
    if ranks:
        p.add_argument("--world-size", type=int, default=2,
                       help="ranks (Gloo on the CPU, NCCL with one GPU per rank on CUDA)")
        p.add_argument("--timeout", type=float, default=1800.0,
                       help="seconds before the ranks are killed")
        p.add_argument("--timing", choices=("throughput", "latency"), default="throughput")
    return p


def parse(p: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse, fill the defaults (``QUICK`` or ``FULL``), check, set torch's threads."""
    from lab2bench.devices import resolve_device

    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    for key in ("batch_size", "context_length", "steps", "rounds", "threads", "world_size"):
        if getattr(args, key, 1) is not None and getattr(args, key, 1) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    unknown = [name for name in args.presets if name not in ("micro", *PRESETS)]
    if unknown:
        p.error(f"unknown preset(s) {', '.join(unknown)}")
    if args.quick and args.threads is None:
        # On a small shared CPU, a second OpenMP thread waiting at every barrier for a core
        # that another process holds makes tiny ops 100x slower.
        args.threads = 1
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    requested = None if args.device == "auto" else args.device
    try:
        device = resolve_device(requested)
    except (ValueError, RuntimeError) as err:
        p.error(str(err))
    args.device = device.type if requested in (None, device.type) else str(device)
    return args


def kind_of(name: str) -> str:
    """The variant ``name`` measures: ``NAME#2`` (any tag after ``#``) is ``NAME`` measured
    again under its own label, in the same rounds: the A/A control of a comparison."""
    return name.split("#", 1)[0]


def check_names(p: argparse.ArgumentParser, what: str, names: Iterable[str],
                known: Iterable[str]) -> list[str]:
    names, known = list(names), list(known)
    bad = [n for n in names if kind_of(n) not in known]
    if len(set(names)) != len(names):
        p.error(f"a {what} is named twice; name its A/A control NAME#2")
    if bad:
        p.error(f"unknown {what}(s) {', '.join(bad)}; choose from {', '.join(known)}")
    return names


# ----------------------------------------------------------------------- workload
def check_paired_options(p: argparse.ArgumentParser, args: argparse.Namespace,
                         cpu_note: str) -> None:
    """Exit through ``p.error`` on a one-GPU paired-window script's bad sizes
    (``--batch-size``, ``--context-length``, ``--rounds``, ``--window``, ``--warmup``) or
    on ``--device cuda`` without a GPU (``cpu_note``: what ``--device cpu`` runs instead)."""
    if min(args.batch_size, args.context_length, args.rounds, args.window) < 1 or args.warmup < 0:
        p.error("--batch-size, --context-length, --rounds and --window must be >= 1, "
                "--warmup >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error(f"no CUDA GPU (--device cpu runs {cpu_note})")


def build_config(preset: str, *, context_length: int, vocab_size: int | None = None,
                 norm: str | None = None) -> ModelConfig:
    """The configuration of ``preset`` (a trainer preset or ``micro``) at the benchmark's
    context length, with the optional vocabulary and norm (None: the preset's)."""
    fields = {"context_length": context_length, "vocab_size": vocab_size, "norm": norm}
    if preset == "micro":
        return model_config("tiny", **{**MICRO, **fields})
    return model_config(preset, **fields)


def build_model(config: ModelConfig, device: torch.device | str, *, seed: int = 0) -> nn.Module:
    from lab2_trainer.models.transformer import TransformerLM

    return TransformerLM(config, seed=seed, device=torch.device(device)).train()


def random_batch(config: ModelConfig, batch_size: int, device: torch.device | str, *,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (inputs, next-token targets), drawn on the CPU: the same on every device."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (batch_size, config.context_length + 1),
                           generator=gen).to(device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def autocast(precision: str, device: torch.device | str) -> contextlib.AbstractContextManager:
    """Autocast to ``precision`` ("fp32": none) on ``device``'s type."""
    if PRECISIONS[precision] is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=getattr(torch, PRECISIONS[precision]))


def free_memory(device: torch.device | str) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors by their local shard; a
    view costs nothing extra)."""
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        key = (str(t.device), t.untyped_storage().data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the optimizer's state, and of any optimizer it wraps
    (``ZeroRedundancyOptimizer.optim``)."""
    holders = [optimizer] + [v for v in vars(optimizer).values()
                             if isinstance(v, torch.optim.Optimizer) and v is not optimizer]
    return [v for h in holders for state in h.state.values() if isinstance(state, dict)
            for v in state.values() if isinstance(v, torch.Tensor)]


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state held now (zero1's own gradient
    buffers where it keeps them)."""
    params = list(model.parameters())
    grads = (optimizer.gradient_bytes() if hasattr(optimizer, "gradient_bytes")
             else storage_bytes(p.grad for p in params if p.grad is not None))
    return {"param_bytes": storage_bytes(params), "grad_bytes": grads,
            "optim_state_bytes": storage_bytes(optimizer_state_tensors(optimizer))}


# ----------------------------------------------------------------------- the trainer's step
def adamw(device: torch.device) -> dict[str, Any]:
    """The trainer's AdamW hyperparameters, at :data:`LR`."""
    defaults = TrainSettings()
    return dict(lr=LR, betas=(defaults.beta1, defaults.beta2),
                weight_decay=defaults.weight_decay, fused=fused_adamw_available(device))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """The trainer's unsharded AdamW (``parallel.build_optimizer``) over ``model``."""
    return build_optimizer(model, **adamw(next(model.parameters()).device))


def setup(model: nn.Module, sharding: str, device: torch.device, *, ddp: str = "none",
          reshard: bool = True, **kwargs: Any) -> Parallel:
    """``model`` set up as the trainer sets it up (``parallelize``: compilation, DDP wrapper
    or sharding, then AdamW); ``kwargs`` go to ``parallelize``."""
    return parallelize(model, sharding=sharding, ddp=ddp, device=device,
                       reshard_after_forward=reshard, **adamw(device), **kwargs)


def make_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], *, mode: str,
              precision: str, device: torch.device,
              optimizer: torch.optim.Optimizer | None = None,
              backward_thread: str = "caller") -> Callable[[], Any]:
    """One unit of work on ``batch``: "forward" (loss included, autograd recording),
    "forward_backward" (gradients set to None first) or "train_step": the trainer's step
    (:func:`lab2_trainer.training.step.train_step`, clipping at the trainer's default included;
    fp16 with a gradient scaler on CUDA) of ``model`` and ``optimizer`` on one process."""
    idx, tgt = batch

    def loss_of() -> torch.Tensor:
        with autocast(precision, device):
            return model(idx, tgt)[1]

    if mode == "forward":
        return loss_of
    if mode == "train_step":
        scaler = (torch.amp.GradScaler("cuda") if precision == "fp16" and device.type == "cuda"
                  else None)
        alone = Parallel(model, optimizer)
        return lambda: train_step(alone, [batch], precision=precision, device=device, clip=CLIP,
                                  scaler=scaler, backward_thread=backward_thread)

    def forward_backward() -> None:
        model.zero_grad(set_to_none=True)
        with backward_on(backward_thread):
            loss_of().backward()
    return forward_backward


def stats_metrics(stats: Any, tokens: int) -> dict[str, Any]:
    """Mean, std and median ms and tokens/s of one ``lab2bench.Stats``."""
    return {"mean_ms": stats.mean * 1e3, "std_ms": stats.std * 1e3,
            "median_ms": stats.median * 1e3,
            "tokens_per_s": tokens / stats.mean if stats.mean > 0 else float("nan"),
            "samples_ms": [s * 1e3 for s in stats.samples]}


def mfu_note(device: str) -> str:
    """The line under a table that says what ``mfu`` is measured against."""
    peak = device_peak(device)
    if peak is None:
        return f"mfu: not reported (no known dense bf16 peak for {device_label(device)})."
    return (f"mfu: model FLOPs (6N + 12·layers·d_model·context per token; a forward a third) "
            f"over {peak.name}, {peak.flops / 1e12:,.0f} TFLOP/s per device.")


def step_marks(p: Parallel, batch: tuple[torch.Tensor, torch.Tensor], precision: str,
               device: torch.device, backward_thread: str = "caller") -> Callable[[], dict]:
    """One training step of ``p`` (the trainer's :func:`lab2_trainer.training.step.train_step`,
    clipping included) marked at every point of :data:`POINTS`: CUDA events on the compute
    stream on GPU (nothing inside the step synchronises), wall time on the CPU. Returns a
    function that reads the marks later: seconds from the start to each point."""
    cuda = device.type == "cuda"
    marks: list[Any] = []

    def mark(point: str | None = None) -> None:
        if cuda:
            marks.append(torch.cuda.Event(enable_timing=True))
            marks[-1].record()
        else:
            marks.append(time.perf_counter())

    mark()
    train_step(p, [batch], precision=precision, device=device, clip=CLIP,
               backward_thread=backward_thread, mark=mark)

    def durations() -> dict[str, float]:
        if cuda:
            torch.cuda.synchronize(device)
            return {n: marks[0].elapsed_time(m) / 1e3 for n, m in zip(POINTS, marks[1:])}
        return {n: m - marks[0] for n, m in zip(POINTS, marks[1:])}
    return durations


# ----------------------------------------------------------------------- ranks
#: What every rank receives: the parsed options, with one preset (:func:`rank_spec`).
RankSpec = argparse.Namespace


def rank_spec(args: argparse.Namespace, preset: str, variants: list[str],
              **extra: Any) -> RankSpec:
    """The options (picklable) with one ``preset``, the ``variants`` and ``extra`` fields,
    which replace options of the same name."""
    return RankSpec(**{**vars(args), "preset": preset, "variants": variants,
                       "back_to_back": args.timing == "throughput", **extra})


def labels(args: argparse.Namespace) -> dict[str, Any]:
    """The configuration fields every multi-rank row carries."""
    return {"world_size": args.world_size, "device": args.device, "precision": args.precision,
            "batch_size": args.batch_size, "context_length": args.context_length,
            "steps": args.steps, "rounds": args.rounds, "warmup": args.warmup,
            "timing": "back to back" if args.timing == "throughput" else "after a barrier",
            "backward_thread": args.backward_thread}


def title(name: str, args: argparse.Namespace) -> str:
    row = labels(args)
    return (f"{name}: {args.world_size} ranks, {args.device}, {args.precision}, batch "
            f"{args.batch_size}/rank x context {args.context_length}, {args.steps} timed "
            f"steps x {args.rounds} rounds, steps timed {row['timing']}, backward on the "
            f"{args.backward_thread} thread")


def single_rank_group(on_gpu: bool) -> torch.device:
    """Join a process group of one (NCCL on GPU 0, else Gloo), so that the DDP wrappers and
    sharded optimizers run as on a rank; returns the device."""
    import os
    import tempfile

    store = os.path.join(tempfile.mkdtemp(prefix="lab2-bench-"), "rendezvous")
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"file://{store}",
                            rank=0, world_size=1)
    if on_gpu:
        torch.cuda.set_device(0)
    return torch.device("cuda", 0) if on_gpu else torch.device("cpu")


def launch(fn: Callable[..., Any], args: argparse.Namespace, spec: RankSpec) -> list[Any]:
    """Run ``fn(rank, world_size, spec)`` on ``args.world_size`` local ranks."""
    from lab2bench.ranks import RankError, spawn_ranks

    preload = ["torch.nn.parallel", "torch.distributed.optim", "tritonnorm", "minddp", "zero1",
               "lab2_trainer.models.transformer", "lab2_trainer.parallel.parallelize", "harness"]
    try:
        return spawn_ranks(fn, args.world_size, spec, device=torch.device(args.device).type,
                           timeout=args.timeout, threads=args.threads, preload=preload)
    except (RankError, ValueError) as err:
        raise SystemExit(f"{Path(sys.argv[0]).name}: {err}") from None


def rank_device() -> torch.device:
    """This rank's device: its GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def base_model(spec: RankSpec, *, norm: str | None = None) -> nn.Module:
    """The initial model, on the CPU (copied to the device per variant)."""
    config = build_config(spec.preset, context_length=spec.context_length,
                          vocab_size=spec.vocab_size, norm=norm or spec.norm)
    return build_model(config, "cpu", seed=spec.seed)


def rank_batches(model: nn.Module, spec: RankSpec, rank: int, device: torch.device,
                 count: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A few batches of this rank's own slice of the data (cycled over the steps)."""
    return [random_batch(model.config, spec.batch_size, device,
                         seed=spec.seed * 1_000_003 + rank * 1009 + i) for i in range(count)]


def fresh_copy(base: nn.Module, device: torch.device) -> nn.Module:
    return copy.deepcopy(base).to(device)


def shared_copy(base: nn.Module) -> nn.Module:
    """A module tree of its own around ``base``'s very ``Parameter`` objects: a float8
    conversion, a compilation or a changed attribute of the copy leaves ``base`` as it is,
    and an optimizer over ``base``'s parameters steps the copy too (one-GPU variants that
    share one model's training state)."""
    memo = {id(p): p for p in base.parameters()}
    return copy.deepcopy(base, memo)


def measure_variants(rank: int, spec: RankSpec, build: Callable[[str], Parallel],
                     batches: list, *, after_variant: Callable | None = None,
                     on_first_step: Callable | None = None) -> dict[str, dict[str, Any]]:
    """Every variant ``spec.rounds`` times (order rotated), ``warmup`` then ``steps`` steps.

    Args:
        build: a fresh variant by name.
        batches: this rank's batches, cycled over the steps.
        after_variant: called with (name, variant, round) after a variant's timed steps.
        on_first_step: runs the first warm-up step of each variant's first round instead of
            a plain step (memory measurement, say); its result is kept under "first_step".

    Returns:
        ``{variant: {"steps": [seconds to each point, per timed step], ...}}``.
    """
    device = rank_device()
    results: dict[str, dict[str, Any]] = {name: {"steps": []} for name in spec.variants}
    for rnd in range(spec.rounds):
        shift = rnd % len(spec.variants)
        for name in spec.variants[shift:] + spec.variants[:shift]:
            t0 = time.perf_counter()
            free_memory(device)
            v = build(name)
            timed = []
            for i in range(spec.warmup + spec.steps):
                if not spec.back_to_back or i <= spec.warmup:  # timed steps start together
                    dist.barrier()
                if i == 0 and on_first_step is not None and rnd == 0:
                    results[name]["first_step"] = on_first_step(name, v)
                    continue
                read = step_marks(v, batches[i % len(batches)], spec.precision, device,
                                  spec.backward_thread)
                if i >= spec.warmup and spec.back_to_back:
                    timed.append(read)  # read once the timed steps are over
                elif i >= spec.warmup:
                    results[name]["steps"].append(read())
                else:
                    read()
            results[name]["steps"] += [read() for read in timed]
            if after_variant is not None:
                after_variant(name, v, rnd)
            del v
            free_memory(device)
            if rank == 0:
                print(f"  [rank 0] round {rnd + 1}/{spec.rounds} {name}: "
                      f"{time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    return results


def summarize(per_rank: list[dict[str, dict[str, Any]]], variant: str) -> dict[str, Any]:
    """The ranks' timings of one variant: a step lasts as long as its slowest rank's; the
    phases (forward, backward, sync wait, optimizer) are means over ranks and steps."""
    from lab2bench import Stats

    runs = [r[variant]["steps"] for r in per_rank]
    n = min(len(s) for s in runs)
    step = Stats.from_samples([max(run[i]["optimizer"] for run in runs) for i in range(n)])

    def phase(a: str | None, b: str) -> float:
        return statistics.fmean(s[b] - (s[a] if a else 0.0) for run in runs for s in run[:n])

    return {"step_ms": step.mean * 1e3, "step_std_ms": step.std * 1e3,
            "step_median_ms": step.median * 1e3, "forward_ms": phase(None, "forward") * 1e3,
            "backward_ms": phase("forward", "backward") * 1e3,
            "sync_wait_ms": phase("backward", "sync") * 1e3,
            "optimizer_ms": phase("sync", "optimizer") * 1e3, "n_steps": n,
            "step_samples_ms": [s * 1e3 for s in step.samples]}


# ----------------------------------------------------------------------- output
class Output:
    """One script's rows: Markdown tables on stdout and, with an output folder, one JSON line
    per row in ``NAME.jsonl`` (``lab2bench.Recorder``), the tables in ``NAME.md`` and PNG
    plots (``lab2bench.plot_sweep``)."""

    def __init__(self, name: str, out_dir: str | None) -> None:
        self.name, self.rows, self.texts = name, [], []
        self.out_dir = Path(out_dir) if out_dir else None
        self._config_keys: list[list[str]] = []

    def add(self, config: dict[str, Any], metrics: dict[str, Any]) -> dict[str, Any]:
        """Keep one row; rows are recorded by :meth:`finish`, with figures added later."""
        self.rows.append({**config, **metrics})
        self._config_keys.append(list(config))
        return self.rows[-1]

    def table(self, columns: list[str], title: str, rows: list[dict] | None = None) -> None:
        from lab2bench import markdown_table

        self.note(f"### {title}\n\n{markdown_table(self.rows if rows is None else rows, columns)}")

    def note(self, text: str) -> None:
        print(text, flush=True)
        self.texts.append(text)

    def plot(self, name: str, *, x: str, y: str, series: str | None,
             rows: list[dict] | None = None, logx: bool = False) -> None:
        rows = [r for r in (self.rows if rows is None else rows)
                if r.get(x) is not None and r.get(y) is not None]
        if self.out_dir is not None and rows:
            from lab2bench import plot_sweep

            plot_sweep(rows, x=x, y=y, series=series, logx=logx,
                       path=self.out_dir / f"{self.name}-{name}.png",
                       title=f"{self.name}: {y} vs {x}")

    def finish(self) -> None:
        if self.out_dir is None:
            return
        from lab2bench import Recorder, atomic_write_text

        recorder = Recorder(self.out_dir / f"{self.name}.jsonl")
        for row, keys in zip(self.rows, self._config_keys):
            recorder.record(self.name, {k: row[k] for k in keys},
                            {k: v for k, v in row.items() if k not in keys})
        atomic_write_text(self.out_dir / f"{self.name}.md", "\n\n".join(self.texts) + "\n")


def speedups(rows: list[dict], key: str, baseline: Any, by: tuple[str, ...]) -> None:
    """``speedup_vs_<baseline>`` of each row: the mean of the row with ``row[key] ==
    baseline`` and the same ``by`` fields over the row's own."""
    base = {tuple(r[k] for k in by): r["mean_ms"] for r in rows if r[key] == baseline}
    for r in rows:
        ref = base.get(tuple(r[k] for k in by))
        r[f"speedup_vs_{baseline}"] = ref / r["mean_ms"] if ref and r["mean_ms"] > 0 else None
