"""What overlapping the column layer's input-gradient reduction with its weight-gradient
matmul saves: forward + backward of one ``ColumnParallelLinear``, overlap on and off.

In backward the layer launches the all-reduce of the input gradient (reduce-scatter under
``--sequence-parallel``) asynchronously, computes the weight gradient meanwhile and waits
last; with ``overlap_grad_reduce=False`` it waits at once. Three layers with the same
weights run interleaved, the order rotating every round, so that a slow phase of a shared
machine hits them alike: ``overlap``, ``no overlap`` and ``overlap (A/A)``, a second copy
of ``overlap``: its ratio to ``overlap`` is the noise floor of the comparison. A window is
``--window`` calls; its time is the slowest rank's (a collective is done when its last
rank is). Ratios are taken per round, then the median (and range) over rounds.

    python packages/minitp/benchmarks/overlap.py --ranks 2               # CPU, Gloo
    python packages/minitp/benchmarks/overlap.py --ranks 2 --device cuda # GPUs, NCCL
    python packages/minitp/benchmarks/overlap.py --quick                 # seconds, CPU

On the CPU, ranks share the machine's cores and Gloo's transport runs on its own thread:
there the figure says whether the collective hides behind the matmul on this host, not
what a GPU would see.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

from lab2bench.ranks import spawn_ranks
from lab2bench.report import markdown_table
from minitp import ColumnParallelLinear

VARIANTS = ("overlap", "no overlap", "overlap (A/A)")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def bench_rank(rank: int, world: int, spec: dict) -> dict[str, list[float]]:
    """One rank: the seconds per call of every window, the slowest rank's, by variant."""
    device = torch.device("cuda", torch.cuda.current_device()) if spec["device"] == "cuda" \
        else torch.device("cpu")
    dtype = DTYPES[spec["dtype"]]
    sp = spec["sequence_parallel"]
    layers = {}
    for name in VARIANTS:
        torch.manual_seed(0)  # the same weights in every variant
        layers[name] = ColumnParallelLinear(
            spec["d_in"], spec["d_out"], bias=False, sequence_parallel=sp, seq_dim=0,
            overlap_grad_reduce=name != "no overlap", device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(1 + rank)
    rows = spec["tokens"] // world if sp else spec["tokens"]
    x = torch.randn(rows, spec["d_in"], generator=gen, device=device,
                    dtype=dtype).requires_grad_()
    grad = torch.randn(spec["tokens"], spec["d_out"] // world, generator=gen, device=device,
                       dtype=dtype)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def call(layer: ColumnParallelLinear) -> None:
        layer(x).backward(grad)
        x.grad = layer.weight.grad = None

    for name in VARIANTS:
        for _ in range(spec["warmup"]):
            call(layers[name])
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for rnd in range(spec["rounds"]):
        order = VARIANTS[rnd % len(VARIANTS):] + VARIANTS[:rnd % len(VARIANTS)]
        for name in order:
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            for _ in range(spec["window"]):
                call(layers[name])
            sync()
            times[name].append((time.perf_counter() - t0) / spec["window"])
    on = device if dist.get_backend() == "nccl" else "cpu"
    slowest = torch.tensor([times[n] for n in VARIANTS], dtype=torch.float64, device=on)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {name: slowest[i].tolist() for i, name in enumerate(VARIANTS)}


def summarize(times: dict[str, list[float]]) -> list[dict]:
    """One row per variant: median ms per call, and its ratio to ``overlap`` (median and
    range over rounds)."""
    base = times["overlap"]
    rows = []
    for name in VARIANTS:
        ratios = [t / b for t, b in zip(times[name], base)]
        rows.append({"variant": name, "ms per call": 1e3 * statistics.median(times[name]),
                     "ratio to overlap": statistics.median(ratios),
                     "range": f"{min(ratios):.3f}-{max(ratios):.3f}"})
    return rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="tensor-parallel ranks (default 2)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--backend", default=None, help="default: gloo on cpu, nccl on cuda")
    p.add_argument("--tokens", type=int, default=4096, help="rows of the input (B·T)")
    p.add_argument("--d-in", type=int, default=1024)
    p.add_argument("--d-out", type=int, default=4096, help="whole layer's output features")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="input sharded along tokens: all-gather / reduce-scatter")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--window", type=int, default=5, help="calls per timed window")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per variant")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per rank (default: cores // ranks)")
    p.add_argument("--quick", action="store_true",
                   help="small sizes and few rounds: a check that it runs, in seconds")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        args.tokens, args.d_in, args.d_out = 256, 256, 1024
        args.rounds, args.window, args.warmup = 3, 2, 1
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.ranks < 1 or args.d_out % args.ranks or (args.sequence_parallel
                                                     and args.tokens % args.ranks):
        raise SystemExit(f"--d-out {args.d_out} (and --tokens {args.tokens} under "
                         f"--sequence-parallel) must divide by --ranks {args.ranks}")
    spec = {"device": args.device, "dtype": dtype, "tokens": args.tokens, "d_in": args.d_in,
            "d_out": args.d_out, "sequence_parallel": args.sequence_parallel,
            "rounds": args.rounds, "window": args.window, "warmup": args.warmup}
    times = spawn_ranks(bench_rank, args.ranks, spec, device=args.device,
                        backend=args.backend, threads=args.threads, timeout=1800,
                        preload=["minitp"])[0]
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    collective = "reduce-scatter" if args.sequence_parallel else "all-reduce"
    print(f"ColumnParallelLinear {args.d_in}->{args.d_out} on {args.ranks} ranks "
          f"({args.device.upper()}, {backend}), {args.tokens} tokens, {dtype}, input "
          f"gradient {collective}; {args.rounds} rounds x {args.window} calls; "
          f"torch {torch.__version__}\n")
    print(markdown_table(summarize(times), floatfmt={"ms per call": ".2f",
                                                     "ratio to overlap": ".3f"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
