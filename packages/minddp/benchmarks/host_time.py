"""Host (CPU) time of one backward with each data-parallel wrapper, at world size 1 over Gloo.

The model is many small layers, so the arithmetic is negligible and what is timed is
the bookkeeping every wrapper does per parameter and per bucket: hooks, copies, flag
updates, collective launches. On a GPU this is the host time that decides whether a
small-batch step is host-bound. Variants run interleaved (the order rotates every round)
on their own copies of the same weights, so slow phases of a shared machine hit all of
them alike.

    python packages/minddp/benchmarks/host_time.py            # table
    python packages/minddp/benchmarks/host_time.py --profile bucketed:0.01
    python packages/minddp/benchmarks/host_time.py --variants local hook:post_accumulate \
        hook:post_accumulate_builtin hook:tensor_hook hook:multi_grad_all:3 \
        hook:multi_grad_all:24                            # what noticing a gradient costs

Variants: ``local`` (no wrapper), ``torch:MB`` (DistributedDataParallel, bucket_cap_mb),
``individual`` (DDPIndividualParameters), ``bucketed:MB`` (DDPBucketed), ``reach:MB``
(DDPBucketed with ``bucket_rule="reach"``, PyTorch's way of cutting buckets), and
``hook:KIND``: no wrapper, but on every parameter a hook that does nothing, of one of the
kinds a data-parallel wrapper could use to notice that a gradient is ready:
``post_accumulate`` (``Tensor.register_post_accumulate_grad_hook``, a Python function, runs
after ``.grad`` is updated), ``post_accumulate_builtin`` (the same with a C-implemented
callable, ``list.append``: the cost of calling into Python at all, without a Python frame),
``tensor_hook`` (``Tensor.register_hook``, before accumulation) and ``multi_grad_all:K``
(``torch.autograd.graph.register_multi_grad_hook(mode="all")`` over buckets of K
parameters: one call per bucket, but a Python hook installed on every tensor underneath).
The default caps: 25 MB (the model fits one bucket) and 0.008 MB, which cuts the model the
way 25 MB cuts the trainer's ``medium`` preset: DDPBucketed never lets a bucket exceed the cap (98
buckets here, 98 for medium's 172 parameters), PyTorch closes a bucket once it reaches
the cap (50 here, 50 for medium), as ``reach:0.008`` does. ``bucketed:0.012`` has
PyTorch's count (49) by a larger cap.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from lab2bench.report import markdown_table

DEFAULT_VARIANTS = ("local", "torch:25", "torch:0.008", "individual", "bucketed:25",
                    "bucketed:0.008", "bucketed:0.012", "reach:0.008")


class Block(nn.Module):
    """Pre-norm residual MLP block: 8 parameters, 4 of them matrices."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.mix = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mix(self.down(torch.relu(self.up(self.norm(x)))))


def build_model(blocks: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(width) for _ in range(blocks)], nn.Linear(width, width))


def install_hooks(kind: str, params: list[nn.Parameter]) -> None:
    """Register hooks of ``kind`` (see the variants ``hook:KIND``) that do nothing."""
    name, _, k = kind.partition(":")
    if name == "post_accumulate":
        for p in params:
            p.register_post_accumulate_grad_hook(lambda _p: None)
    elif name == "post_accumulate_builtin":
        sink: list = []
        for p in params:
            p.register_post_accumulate_grad_hook(sink.append)
    elif name == "tensor_hook":
        for p in params:
            p.register_hook(lambda _g: None)
    elif name == "multi_grad_all":
        for i in range(0, len(params), int(k)):
            torch.autograd.graph.register_multi_grad_hook(params[i : i + int(k)],
                                                          lambda _gs: None, mode="all")
    else:
        raise ValueError(f"unknown hook kind {kind!r}")


def wrap(variant: str, model: nn.Module) -> tuple[nn.Module, Callable[[], None]]:
    """The module to run forward through and the call that ends a step's synchronization."""
    kind, _, mb = variant.partition(":")
    if kind == "hook":
        install_hooks(mb, list(model.parameters()))
    if kind in ("local", "hook"):
        return model, lambda: None
    if kind == "torch":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, bucket_cap_mb=float(mb))
        return ddp, lambda: None  # its Reducer finishes inside backward
    from minddp import DDPBucketed, DDPIndividualParameters

    if kind == "individual":
        ddp = DDPIndividualParameters(model)
    elif kind in ("bucketed", "reach"):
        ddp = DDPBucketed(model, float(mb), bucket_rule="reach" if kind == "reach" else "at_most")
    else:
        raise ValueError(f"unknown variant {variant!r}")
    return ddp, ddp.finish_gradient_synchronization


def collectives_per_step(variant: str, runner: nn.Module) -> int | None:
    """Collectives the last step launched (PyTorch DDP: its buckets; local: 0)."""
    if variant == "local" or variant.startswith("hook:"):
        return 0
    stats = getattr(runner, "last_sync_stats", None)
    if stats is not None:
        return stats.launched_in_backward + stats.launched_in_finish
    reducer = getattr(runner, "reducer", None)
    try:  # a private call of PyTorch's Reducer: informative only
        return len(reducer._get_zeros_like_grad_buckets())
    except (AttributeError, RuntimeError):
        return None


def one_step(model: nn.Module, runner: nn.Module, finish: Callable[[], None],
             x: torch.Tensor) -> tuple[float, ...]:
    """One step without the optimizer. Seconds of the main thread's CPU time for forward,
    backward (autograd runs CPU graphs on the calling thread) and the finish call, then
    the wall time of backward."""
    model.zero_grad(set_to_none=True)
    c0 = time.thread_time()
    loss = runner(x).square().mean()
    c1 = time.thread_time()
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    c2 = time.thread_time()
    finish()
    c3 = time.thread_time()
    return c1 - c0, c2 - c1, c3 - c2, t2 - t1


def measure(variants: list[str], args: argparse.Namespace
            ) -> tuple[dict[str, list[list[tuple]]], dict[str, int | None]]:
    """Per variant, per round, the timings of each step; and collectives per step."""
    base = build_model(args.blocks, args.width)
    x = torch.randn(args.batch, args.width)
    built = {}
    for v in variants:
        model = copy.deepcopy(base)
        runner, finish = wrap(v, model)
        built[v] = (model, runner, finish)
    samples: dict[str, list[list[tuple]]] = {v: [] for v in variants}
    for rnd in range(args.rounds):
        shift = rnd % len(variants)
        for v in variants[shift:] + variants[:shift]:
            model, runner, finish = built[v]
            for _ in range(args.warmup):
                one_step(model, runner, finish, x)
            samples[v].append([one_step(model, runner, finish, x) for _ in range(args.steps)])
    collectives = {v: collectives_per_step(v, built[v][1]) for v in variants}
    return samples, collectives


def report(samples: dict[str, list[list[tuple]]], collectives: dict[str, int | None],
           n_params: int) -> None:
    """Medians over all steps; the extra over ``local`` is paired round by round (each
    round runs all variants back to back), so slow phases of the machine cancel."""

    def round_totals(v: str) -> list[float]:
        return [statistics.median([s[1] + s[2] for s in r]) * 1e6 for r in samples[v]]

    rows = []
    for v, rounds in samples.items():
        fwd, bwd, finish, wall = (statistics.median([s[i] for r in rounds for s in r]) * 1e6
                                  for i in range(4))
        row = {"variant": v, "collectives": "?" if collectives[v] is None else collectives[v],
               "forward": fwd, "backward": bwd, "finish": finish, "backward + finish":
               bwd + finish, "backward wall": wall}
        if "local" in samples:
            pairs = list(zip(round_totals(v), round_totals("local")))
            row["× local"] = f"{statistics.median([t / loc for t, loc in pairs]):.2f}"
            diffs = [(t - loc) / n_params for t, loc in pairs]
            quartiles = statistics.quantiles(diffs, n=4) if len(diffs) >= 4 else None
            row["extra per parameter"] = f"{statistics.median(diffs):.1f}" + (
                f" [{quartiles[0]:.1f}, {quartiles[2]:.1f}]" if quartiles else "")
        rows.append(row)
    print(f"{n_params} trainable parameters; {len(next(iter(samples.values())))} rounds; CPU "
          "µs of the main thread (medians) unless marked wall; extra = (backward + finish) - "
          "local's, per parameter, median of the rounds [quartiles]")
    print(markdown_table(rows, floatfmt=".0f"))


def profile(variant: str, args: argparse.Namespace) -> None:
    """The torch profiler's table of a few steps: where the host time goes."""
    model = build_model(args.blocks, args.width)
    runner, finish = wrap(variant, model)
    x = torch.randn(args.batch, args.width)
    for _ in range(args.warmup):
        one_step(model, runner, finish, x)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            one_step(model, runner, finish, x)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS))
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", metavar="VARIANT",
                        help="print the torch profiler's table for this variant instead")
    parser.add_argument("--rows", type=int, default=25, help="rows of the profiler table")
    args = parser.parse_args(argv)
    if min(args.blocks, args.width, args.batch, args.rounds, args.steps) < 1:
        parser.error("--blocks, --width, --batch, --rounds and --steps must be positive")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "init"),
                                rank=0, world_size=1)
        try:
            if args.profile:
                profile(args.profile, args)
            else:
                n = sum(p.numel() > 0 for p in build_model(args.blocks, args.width).parameters())
                print(f"torch {torch.__version__}, python {sys.version.split()[0]}, "
                      f"{args.threads} thread(s)")
                report(*measure(list(args.variants), args), n)
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
