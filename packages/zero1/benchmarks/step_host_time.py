"""Host time of one optimizer step on a model with many small parameters (CPU, Gloo).

With small tensors the arithmetic is negligible and a step costs what the Python around it
costs: that is what this measures. Gradients are set once (random, not zero) and every
timed call is ``optimizer.step()`` alone, so only the optimizer's own work is counted.

Variants, measured one after the other in the same ranks, rounds rotated:

* ``plain``: ``torch.optim.AdamW`` over every parameter (its defaults: on the CPU, a
  Python loop over parameters).
* ``sharded``: ``ShardedOptimizer(AdamW, foreach=True)``: the local AdamW's foreach
  kernels (PyTorch's default picks them on CUDA only).
* ``sharded-loop``: ``ShardedOptimizer(AdamW, foreach=False)``: its per-parameter loop.
* ``zero``: ``ZeroRedundancyOptimizer(AdamW)``, for reference (world size > 1 only:
  it needs a process group, and at 1 rank it is plain AdamW).

Reported per variant: wall µs and process CPU µs per step (median over the timed steps
of the slowest rank), and for the sharded variants the part spent in the local step.

    python packages/zero1/benchmarks/step_host_time.py --world-sizes 1,2
    python packages/zero1/benchmarks/step_host_time.py --layers 256 --width 32 --steps 50
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from lab2bench.ranks import spawn_ranks

VARIANTS = ("plain", "sharded", "sharded-loop", "zero")


def build_model(spec: argparse.Namespace) -> torch.nn.Module:
    """``layers`` x (Linear(width, width) + LayerNorm(width)): four tensors per layer."""
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(spec.layers):
        mods += [torch.nn.Linear(spec.width, spec.width), torch.nn.LayerNorm(spec.width)]
    model = torch.nn.Sequential(*mods)
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    return model


def build_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = list(model.parameters())
    kwargs = dict(lr=1e-3, weight_decay=0.1)
    if name == "plain":
        return torch.optim.AdamW(params, **kwargs)
    if name == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **kwargs)
    from zero1 import ShardedOptimizer

    kwargs["foreach"] = name != "sharded-loop"
    return ShardedOptimizer(params, torch.optim.AdamW, **kwargs)


def _local_step_timer(opt: torch.optim.Optimizer, sink: list[float]) -> None:
    """Time every call of a ShardedOptimizer's local step (wall seconds into ``sink``)."""
    local = getattr(opt, "local_optimizer", None)
    if local is None:
        return
    inner = local.step

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - t0)

    local.step = timed


def bench_rank(rank: int, world_size: int, spec: argparse.Namespace) -> dict:
    """One rank (``lab2bench.ranks.spawn_ranks``' target, in its process group): the
    timings of every variant, ``{variant: {"wall"|"cpu"|"local": [seconds]}}``."""
    names = [n for n in VARIANTS if n != "zero" or world_size > 1]
    out = {n: {"wall": [], "cpu": [], "local": []} for n in names}
    for rnd in range(spec.rounds):
        order = names[rnd % len(names):] + names[: rnd % len(names)]
        for name in order:
            model = build_model(spec)
            opt = build_optimizer(name, model)
            local: list[float] = []
            _local_step_timer(opt, local)
            for i in range(spec.warmup + spec.steps):
                dist.barrier()
                w0, c0 = time.perf_counter(), time.process_time()
                opt.step()
                w1, c1 = time.perf_counter(), time.process_time()
                if i >= spec.warmup:
                    out[name]["wall"].append(w1 - w0)
                    out[name]["cpu"].append(c1 - c0)
            out[name]["local"] += local[spec.warmup:]
            del opt, model
    return out


def _median_us(per_rank: list[dict], name: str, key: str) -> float | None:
    """Median over steps of the slowest rank's value."""
    runs = [r[name][key] for r in per_rank]
    n = min(len(x) for x in runs)
    if n == 0:
        return None
    return statistics.median(max(run[i] for run in runs) for i in range(n)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="1,2", help="comma-separated (default 1,2)")
    parser.add_argument("--layers", type=int, default=128, help="Linear+LayerNorm pairs")
    parser.add_argument("--width", type=int, default=64, help="width of each layer")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = build_model(args)
    n_tensors = len(list(model.parameters()))
    n_elems = sum(p.numel() for p in model.parameters())
    print(f"{n_tensors} parameter tensors, {n_elems:,} elements; torch {torch.__version__}; "
          f"{args.rounds} rounds x {args.steps} steps (after {args.warmup} warm-up), "
          "1 thread per rank\n")
    print("| world size | variant | wall µs/step | CPU µs/step | local step µs |")
    print("|---:|---|---:|---:|---:|")
    for ws in (int(x) for x in args.world_sizes.split(",")):
        # A deadline: a rank that raises, dies or hangs ends the run with its name.
        per_rank = spawn_ranks(bench_rank, ws, args, threads=1, timeout=1200,
                               preload=["zero1", "torch.distributed.optim"])
        for name in per_rank[0]:
            us = (_median_us(per_rank, name, key) for key in ("wall", "cpu", "local"))
            print(f"| {ws} | {name} | " + " | ".join("-" if v is None else f"{v:,.0f}" for v in us)
                  + " |", flush=True)


if __name__ == "__main__":
    main()
