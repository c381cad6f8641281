"""Training-step time of several set-ups of one model, in short paired windows.

The bench suites time each variant in windows of 20 steps. On a host whose speed drifts
by tens of percent within seconds, that is too coarse to resolve a 5% difference. Here
every variant lives in one process for the whole run; each round times a window of a few
back-to-back steps of every variant (order rotated each round), and each variant is
compared with the first one *within the same round*: the medians of those paired ratios
and differences cancel the drift that the window means do not.

A variant is ``NORM:DDP[:RULE][+SHARDING][@THREAD]``:
    NORM      the model's norm layer: tritonnorm or torch (``nn.RMSNorm``);
    DDP       the trainer's GradSync kind: none, bucketed, torch (one rank; bucketed and
              torch launch no collective on a group of one, but do all their bookkeeping);
    RULE      bucketed's bucket rule: reach (default) or at_most;
    SHARDING  the trainer's --sharding: none (default), zero1 / zero2 (ShardedOptimizer
              reducing the gradients itself: DDP must be none), zero1-allreduce
              (ShardedOptimizer after the DDP wrapper), torch (ZeroRedundancyOptimizer) or
              fsdp;
    THREAD    the thread that runs backward: caller (default) or autograd.

Each step is the trainer's (``bench.distributed.step_marks``): forward under bf16
autocast, backward, gradient synchronisation, fused AdamW (sharded as asked). The whole
stacks of ``bench stack``, ours against PyTorch's::

    python apps/trainer/benchmarks/paired.py --preset small \\
        --variants torch:torch+torch tritonnorm:bucketed+zero1-allreduce

    python apps/trainer/benchmarks/paired.py --preset medium \\
        --variants torch:none@autograd torch:none tritonnorm:none tritonnorm:bucketed
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lab2_trainer.bench.distributed import (
    fresh_copy,
    make_sharded_variant,
    make_variant,
    step_marks,
)
from lab2_trainer.bench.workload import build_config, build_model, random_batch
from lab2_trainer.config import (
    BACKWARD_THREADS,
    BUCKET_RULES,
    SELF_REDUCING,
    SHARDING_KINDS,
)


@dataclass(frozen=True)
class Setup:
    """One parsed variant string (see the module docstring)."""

    name: str
    norm: str
    ddp: str
    rule: str
    sharding: str
    thread: str


def parse_variant(text: str) -> Setup:
    body, _, thread = text.partition("@")
    body, _, sharding = body.partition("+")
    parts = body.split(":")
    if len(parts) not in (2, 3):
        raise SystemExit(f"paired.py: variant {text!r} is not "
                         "NORM:DDP[:RULE][+SHARDING][@THREAD]")
    norm, ddp = parts[0], parts[1]
    rule = parts[2] if len(parts) == 3 else "reach"
    thread = thread or "caller"
    sharding = sharding or "none"
    checks = ((norm, ("tritonnorm", "torch")), (ddp, ("none", "bucketed", "torch")),
              (rule, BUCKET_RULES), (sharding, SHARDING_KINDS), (thread, BACKWARD_THREADS))
    for value, allowed in checks:
        if value not in allowed:
            raise SystemExit(f"paired.py: {value!r} in {text!r} is not one of "
                             f"{', '.join(allowed)}")
    return Setup(text, norm, ddp, rule, sharding, thread)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="medium")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--context-length", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=10000)
    p.add_argument("--variants", nargs="+", required=True,
                   help="NORM:DDP[:RULE][+SHARDING][@THREAD] ...; the first is the baseline")
    p.add_argument("--rounds", type=int, default=14)
    p.add_argument("--window", type=int, default=5, help="timed steps per window")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu (Gloo): a smoke test of the script, with --preset micro")
    args = p.parse_args()
    if args.rounds < 1 or args.window < 1:
        p.error("--rounds and --window must be positive")
    return args


def main() -> None:
    args = parse_args()
    on_gpu = args.device == "cuda"
    if on_gpu and not torch.cuda.is_available():
        raise SystemExit("paired.py: no CUDA GPU (--device cpu runs a smoke test)")
    setups = [parse_variant(v) for v in args.variants]
    store = os.path.join(tempfile.mkdtemp(), "rendezvous")
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"file://{store}",
                            rank=0, world_size=1)
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    bases, variants = {}, {}
    for s in setups:
        if s.norm not in bases:
            config = build_config(args.preset, context_length=args.context_length,
                                  vocab_size=args.vocab_size, norm=s.norm)
            bases[s.norm] = (build_model(config, "cpu", seed=0),
                             random_batch(config, args.batch_size, device, seed=0))
        model = fresh_copy(bases[s.norm][0], device)
        if s.sharding in SELF_REDUCING:
            if s.ddp != "none":
                raise SystemExit(f"{s.name}: --sharding {s.sharding} reduces gradients "
                                 "itself; use DDP none")
            variants[s.name] = make_sharded_variant(model, s.sharding, device,
                                                    bucket_rule=s.rule)
        else:
            variants[s.name] = make_variant(model, s.ddp, s.sharding, device,
                                            bucket_rule=s.rule)

    def window(s: Setup, steps: int) -> float:
        """Mean ms per step of ``steps`` back-to-back steps (one untimed step first)."""
        v, batch = variants[s.name], bases[s.norm][1]
        for i in range(steps + 1):
            if i == 1:
                sync()
                start = time.perf_counter()
            step_marks(v, batch, "bf16", device, s.thread)  # its marks go unread
        sync()
        return (time.perf_counter() - start) / steps * 1e3

    for s in setups:  # warm-up: compile the kernels, fill the allocator
        window(s, 3)
    times: dict[str, list[float]] = {s.name: [] for s in setups}
    for rnd in range(args.rounds):
        shift = rnd % len(setups)
        for s in setups[shift:] + setups[:shift]:
            times[s.name].append(window(s, args.window))
    base = setups[0].name
    where = torch.cuda.get_device_name(device) if on_gpu else "CPU"
    print(f"{args.preset}, batch {args.batch_size} x {args.context_length}, one "
          f"{where}, {args.rounds} rounds x {args.window} "
          f"steps; paired with {base} round by round")
    print(f"| variant | median ms | min ms | {base} / variant [quartiles] "
          f"| variant - {base} ms |")
    print("|---|---:|---:|---:|---:|")
    for s in setups:
        ratios = [b / t for t, b in zip(times[s.name], times[base])]
        diffs = [t - b for t, b in zip(times[s.name], times[base])]
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (0, 0, 0)
        print(f"| {s.name} | {statistics.median(times[s.name]):.2f} | "
              f"{min(times[s.name]):.2f} | {statistics.median(ratios):.3f} "
              f"[{q1:.3f}, {q3:.3f}] | {statistics.median(diffs):+.2f} |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
