"""Host time per call of what minitp runs in eager mode against the alternatives: each
collective through ``torch.distributed`` (``async_op=True`` then ``work.wait()``, minitp's
eager path) and as a functional collective (``torch.ops._c10d_functional``, then
``wait_tensor``: the ops minitp traces under ``torch.compile``), and dropout as
``F.dropout`` and as ``minitp.sharded_dropout`` (a forked stream per call).

Tensors are tiny (``--numel`` elements), so that the figures are the host's cost of
issuing a call, not the bytes. Two numbers per variant, each the median over rounds of the
slowest rank's mean over a window of ``--window`` calls: the time to *issue* them (the
calling thread's cost; the collectives are waited for after the window) and the time per
call issued and waited for one at a time (the transport's latency included). The variants
run interleaved, the order rotating every round, and an A/A copy of the first variant of
each kind gives the noise floor.

    python packages/minitp/benchmarks/host_time.py --ranks 2      # CPU, Gloo
    python packages/minitp/benchmarks/host_time.py --quick        # seconds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lab2bench.ranks import spawn_ranks
from lab2bench.report import markdown_table
from minitp.mappings import start_all_gather, start_all_reduce, start_reduce_scatter
from minitp.random import sharded_dropout


def _variants(x: torch.Tensor, n: int) -> dict[str, dict[str, Callable[[], Callable]]]:
    """kind -> variant -> a function that issues one call and returns its waiter."""
    ops = torch.ops._c10d_functional
    name = dist.group.WORLD.group_name

    def eager(start):
        def issue():
            return start().wait
        return issue

    def functional(op):
        def issue():
            out = op()
            return lambda: ops.wait_tensor(out)
        return issue

    def at_once(fn):
        def issue():
            fn()
            return lambda: None
        return issue

    reduce = {"torch.distributed": eager(lambda: start_all_reduce(x.clone(), None, "forward")),
              "functional": functional(lambda: ops.all_reduce(x, "sum", name))}
    gather = {"torch.distributed": eager(lambda: start_all_gather(x, 0, None, "forward")),
              "functional": functional(lambda: ops.all_gather_into_tensor(x, n, name))}
    scatter = {"torch.distributed": eager(lambda: start_reduce_scatter(x, 0, None,
                                                                       "forward")),
               "functional": functional(lambda: ops.reduce_scatter_tensor(x, "sum", n, name))}
    dropout = {"F.dropout": at_once(lambda: F.dropout(x, 0.1, True)),
               "sharded_dropout": at_once(lambda: sharded_dropout(x, 0.1, True, dim=0))}
    out = {"all-reduce": reduce, "all-gather": gather, "reduce-scatter": scatter,
           "dropout": dropout}
    for variants in out.values():
        first = next(iter(variants))
        variants[f"{first} (A/A)"] = variants[first]
    return out


def bench_rank(rank: int, world: int, spec: dict) -> dict:
    x = torch.randn(spec["numel"] * world)  # divides by the ranks: scatter it along dim 0
    kinds = _variants(x, world)
    window = spec["window"]
    times: dict = {(k, v, m): [] for k, vs in kinds.items() for v in vs
                   for m in ("issue", "call")}
    for rnd in range(spec["warmup"] + spec["rounds"]):
        for kind, variants in kinds.items():
            names = list(variants)
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for name in order:
                issue = variants[name]
                dist.barrier()
                t0 = time.perf_counter()
                waiters = [issue() for _ in range(window)]
                t1 = time.perf_counter()
                for wait in waiters:
                    wait()
                dist.barrier()
                t2 = time.perf_counter()
                for _ in range(window):
                    issue()()
                t3 = time.perf_counter()
                if rnd >= spec["warmup"]:
                    times[(kind, name, "issue")].append((t1 - t0) / window)
                    times[(kind, name, "call")].append((t3 - t2) / window)
    keys = list(times)
    slowest = torch.tensor([times[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {k: slowest[i].tolist() for i, k in enumerate(keys)}


def summarize(times: dict) -> list[dict]:
    rows = []
    for kind, name, measure in times:
        if measure != "issue":
            continue
        rows.append({"kind": kind, "variant": name,
                     "us to issue": 1e6 * statistics.median(times[(kind, name, "issue")]),
                     "us per call": 1e6 * statistics.median(times[(kind, name, "call")])})
    return rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--numel", type=int, default=64, help="elements per rank's part")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--window", type=int, default=50, help="calls per timed window")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds")
    p.add_argument("--quick", action="store_true", help="few rounds: a check that it runs")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        args.rounds, args.window, args.warmup = 2, 5, 1
    if args.ranks < 2:
        raise SystemExit("--ranks must be at least 2 (one rank communicates nothing)")
    spec = {"numel": args.numel, "rounds": args.rounds, "window": args.window,
            "warmup": args.warmup}
    times = spawn_ranks(bench_rank, args.ranks, spec, device="cpu", threads=1,
                        timeout=1800, preload=["minitp"])[0]
    print(f"{args.ranks} ranks (CPU, gloo), {args.numel} float32 elements per rank; "
          f"{args.rounds} rounds x {args.window} calls; torch {torch.__version__}\n")
    print(markdown_table(summarize(times), floatfmt={"us to issue": ".1f",
                                                     "us per call": ".1f"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
