"""What each way of noticing "this gradient is ready" costs autograd, per parameter.

Times a backward of the host_time model (many small layers) with no hook, then with
one of the hook kinds a data-parallel wrapper could use, all doing nothing:

* ``post_accumulate``: ``Tensor.register_post_accumulate_grad_hook``, a Python function
  per parameter (runs after ``.grad`` is updated);
* ``post_accumulate_builtin``: the same with a C-implemented callable (``list.append``):
  the cost of calling into Python at all, without a Python frame;
* ``tensor_hook``: ``Tensor.register_hook`` per parameter (runs before accumulation);
* ``multi_grad_all:K``: ``torch.autograd.graph.register_multi_grad_hook(mode="all")`` over
  buckets of K parameters (one call per bucket, but it installs a Python hook on every
  tensor underneath).

    python packages/minddp/benchmarks/hook_cost.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from host_time import build_model
from torch import nn

KINDS = ("none", "post_accumulate", "post_accumulate_builtin", "tensor_hook",
         "multi_grad_all:3", "multi_grad_all:24")


def install(kind: str, params: list[nn.Parameter]) -> list:
    """Register hooks of ``kind`` that do nothing; returns the handles."""
    name, _, k = kind.partition(":")
    if name == "none":
        return []
    if name == "post_accumulate":
        return [p.register_post_accumulate_grad_hook(lambda _p: None) for p in params]
    if name == "post_accumulate_builtin":
        sink: list = []
        return [p.register_post_accumulate_grad_hook(sink.append) for p in params]
    if name == "tensor_hook":
        return [p.register_hook(lambda _g: None) for p in params]
    if name == "multi_grad_all":
        size = int(k)
        groups = [params[i : i + size] for i in range(0, len(params), size)]
        return [torch.autograd.graph.register_multi_grad_hook(g, lambda _gs: None, mode="all")
                for g in groups]
    raise ValueError(f"unknown hook kind {kind!r}")


def backward_cpu_seconds(model: nn.Module, x: torch.Tensor) -> float:
    model.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    start = time.thread_time()
    loss.backward()
    return time.thread_time() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    if min(args.blocks, args.width, args.rounds, args.steps) < 1:
        parser.error("--blocks, --width, --rounds and --steps must be positive")
    torch.set_num_threads(1)
    models = {}
    for kind in KINDS:
        model = build_model(args.blocks, args.width)
        install(kind, list(model.parameters()))
        models[kind] = model
    n = len(list(models["none"].parameters()))
    x = torch.randn(4, args.width)
    # Interleaved, rotating order; each round's median is compared with the same
    # round's "none", so slow phases of a shared machine cancel.
    rounds: dict[str, list[float]] = {k: [] for k in KINDS}
    for rnd in range(args.rounds):
        order = KINDS[rnd % len(KINDS):] + KINDS[: rnd % len(KINDS)]
        for kind in order:
            for _ in range(2):
                backward_cpu_seconds(models[kind], x)
            rounds[kind].append(statistics.median(
                backward_cpu_seconds(models[kind], x) for _ in range(args.steps)))
    print(f"{n} parameters; backward CPU µs of the main thread (median of round medians); "
          f"extra = per parameter over 'none' in the same round, median of {args.rounds} "
          "rounds [quartiles]")
    print("| hook | backward | extra per parameter |")
    print("|---|---:|---:|")
    for kind in KINDS:
        diffs = [(r - base) / n * 1e6 for r, base in zip(rounds[kind], rounds["none"])]
        q1, med, q3 = statistics.quantiles(diffs, n=4) if len(diffs) >= 4 else [0.0] * 3
        med = statistics.median(diffs)
        print(f"| {kind} | {statistics.median(rounds[kind]) * 1e6:.0f} | "
              f"{med:.2f} [{q1:.2f}, {q3:.2f}] |")

if __name__ == "__main__":
    main()
