"""Muon's optimizer step against AdamW's, and what each sends per step when sharded.

**Step time** (one process; CPU, or CUDA where present): ``optimizer.step()`` alone over
the matrices of ``--layers`` Transformer-like layers of width W (attention's four W × W,
the MLP's 4W × W and W × 4W: 12W² elements a layer), gradients set once. The variants
run in short windows interleaved round by round (``lab2bench.timing.paired_windows``):

* ``adamw``: ``torch.optim.AdamW`` (PyTorch's default implementation), the baseline;
* ``adamw#2``: another AdamW, the A/A control: its ratio is the noise of the measure;
* ``muon``: ``zero1.Muon``, the iteration in bfloat16 (PyTorch's choice);
* ``muon-fp32``: ``zero1.Muon(ns_dtype=torch.float32)``.

Reported: the median ms per step, the ratio (AdamW's time over the variant's, the
median over rounds: below 1, slower than AdamW) with its quartiles, and for Muon the
Newton-Schulz FLOPs per step (5 × (4m²n + 2m³) per m × n matrix, m ≤ n) and their rate.

**Bytes** (``--bytes``: Gloo ranks on the CPU): the elements each rank sends in a steady
step (the second) under stages 1, 2 and 3, with Muon on the hidden matrices and AdamW on
the rest (embedding, output layer, norms, biases) against AdamW on both, counted from the
collectives' sizes as ``lab2bench.comm.count_collectives`` does, plus the all-to-alls
that bring each matrix to its owner and back (sent to other ranks).

    python packages/zero1/benchmarks/muon.py --width 512 --layers 2 --rounds 10
    python packages/zero1/benchmarks/muon.py --quick
    python packages/zero1/benchmarks/muon.py --bytes --world-sizes 2,4 --width 64 --layers 4
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


# ------------------------------------------------------------------ step time
def layer_shapes(width: int, layers: int) -> list[tuple[int, int]]:
    """The matrices of ``layers`` Transformer layers: q, k, v, o, MLP up and down."""
    one = [(width, width)] * 4 + [(4 * width, width), (width, 4 * width)]
    return one * layers


def ns_flops(shapes: list[tuple[int, int]], steps: int = 5) -> int:
    """Multiply-adds × 2 of the Newton-Schulz iterations of one step over ``shapes``."""
    total = 0
    for rows, cols in shapes:
        m, n = min(rows, cols), max(rows, cols)
        total += steps * (4 * m * m * n + 2 * m**3)
    return total


def _params(shapes: list[tuple[int, int]], device: torch.device) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for shape in shapes:
        p = nn.Parameter(torch.randn(shape, generator=gen).mul_(0.02).to(device))
        p.grad = torch.randn(shape, generator=gen).to(device)
        params.append(p)
    return params


def build_variants(shapes: list[tuple[int, int]], device: torch.device) -> dict[str, Any]:
    """Each variant's step, over its own copy of the parameters (same values)."""
    from zero1 import Muon

    makers = {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
        "adamw#2": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
        "muon": lambda ps: Muon(ps, lr=0.02, weight_decay=0.1),
        "muon-fp32": lambda ps: Muon(ps, lr=0.02, weight_decay=0.1, ns_dtype=torch.float32),
    }
    return {name: make(_params(shapes, device)).step for name, make in makers.items()}


def time_steps(args: argparse.Namespace) -> list[dict[str, Any]]:
    from lab2bench.timing import paired_windows

    device = torch.device(args.device)
    shapes = layer_shapes(args.width, args.layers)
    results = paired_windows(build_variants(shapes, device), rounds=args.rounds,
                             window=args.window, device=device, warmup=args.warmup)
    flops = ns_flops(shapes)
    rows = []
    for name, got in results.items():
        row = {"variant": name, "median_ms": got["median_ms"], "ratio": got["ratio"],
               "ratio_q1": got["ratio_q1"], "ratio_q3": got["ratio_q3"]}
        if name.startswith("muon"):
            row["ns_gflop"] = flops / 1e9
            row["ns_gflops_per_s"] = flops / 1e9 / (got["median_ms"] / 1e3)
        rows.append(row)
    return rows


# ------------------------------------------------------------------ bytes per step
VOCAB = 97


class Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm1(h)  # a stand-in for attention: every matrix used, shapes as in one
        h = h + self.o(torch.tanh(self.q(x)) * self.k(x) + self.v(x))
        return h + self.down(F.gelu(self.up(self.norm2(h))))


class Model(nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleList(Layer(width) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def bytes_rank(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Elements this rank sends in the second step, per stage and optimizer pairing."""
    import zero1
    from lab2bench.comm import count_collectives

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for stage in (1, 2, 3):
        for name in ("adamw", "muon"):
            model = Model(spec["width"], spec["layers"])
            matrices = [p for n, p in model.named_parameters()
                        if p.dim() == 2 and n.startswith("layers.")]
            rest = [p for p in model.parameters() if all(p is not q for q in matrices)]
            cls, kwargs = ((zero1.Muon, {"lr": 0.02}) if name == "muon"
                           else (torch.optim.AdamW, {"lr": 1e-3}))
            if stage == 3:
                zero1.shard_model(model)
                opts = [zero1.Stage3Optimizer(matrices, cls, **kwargs),
                        zero1.Stage3Optimizer(rest, torch.optim.AdamW, lr=1e-3)]
            else:
                opts = [zero1.ShardedOptimizer(matrices, cls, stage=stage, **kwargs),
                        zero1.ShardedOptimizer(rest, torch.optim.AdamW, stage=stage, lr=1e-3)]
            gen = torch.Generator().manual_seed(rank)
            with count_collectives() as counted:
                for _ in range(2):
                    counted.reset()
                    tokens = torch.randint(0, VOCAB, (2, 16), generator=gen)
                    logits = model(tokens)
                    F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
                    for opt in opts:
                        opt.step()
                    for opt in opts:
                        opt.zero_grad()
            a2a = sum(n for kind, n, _ in counted.calls if kind == "all_to_all_single")
            out[f"{stage}/{name}"] = {"collectives": counted.volume_elements - a2a,
                                      "all_to_all": a2a}
            out["psi"] = sum(p.numel() for p in model.parameters())
            out["psi_matrices"] = sum(p.numel() for p in matrices)
    return out


def count_bytes(args: argparse.Namespace) -> list[dict[str, Any]]:
    from lab2bench.ranks import spawn_ranks

    rows = []
    spec = {"width": args.width, "layers": args.layers}
    for world in args.world_sizes:
        per_rank = spawn_ranks(bytes_rank, world, spec, threads=1, timeout=1200,
                               preload=["zero1"])
        psi, psi_m = per_rank[0]["psi"], per_rank[0]["psi_matrices"]
        for stage in (1, 2, 3):
            adamw = statistics.mean(r[f"{stage}/adamw"]["collectives"] for r in per_rank)
            base = statistics.mean(r[f"{stage}/muon"]["collectives"] for r in per_rank)
            a2a = statistics.mean(r[f"{stage}/muon"]["all_to_all"] for r in per_rank)
            moved = 2 if stage != 3 else 3
            rows.append({"world_size": world, "stage": stage, "psi": psi, "psi_matrices": psi_m,
                         "adamw_per_psi": adamw / psi, "muon_per_psi": (base + a2a) / psi,
                         "all_to_all_per_psi": a2a / psi,
                         "formula_per_psi": moved * psi_m * (world - 1) / world**2 / psi})
    return rows


# ------------------------------------------------------------------ command line
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=512, help="model width W (default 512)")
    p.add_argument("--layers", type=int, default=2, help="Transformer layers (default 2)")
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu or cuda")
    p.add_argument("--rounds", type=int, default=10, help="windows per variant (default 10)")
    p.add_argument("--window", type=int, default=3, help="steps per window (default 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--quick", action="store_true",
                   help="a seconds-long check on the CPU: width 64, 1 layer, 2 rounds of 2")
    p.add_argument("--bytes", action="store_true",
                   help="count the elements sent per step on Gloo ranks instead of timing")
    p.add_argument("--world-sizes", default="2,4", help="--bytes: comma-separated (2,4)")
    p.add_argument("--out", help="append one JSON line per result here (lab2bench records)")
    args = p.parse_args(argv)
    if args.quick:
        args.width, args.layers, args.device = 64, 1, "cpu"
        args.rounds, args.window, args.warmup = 2, 2, 1
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device not in ("cpu", "cuda") or (args.device == "cuda"
                                              and not torch.cuda.is_available()):
        p.error(f"--device {args.device!r}: use auto, cpu or cuda (with a GPU present)")
    for name in ("width", "layers", "rounds", "window"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    try:
        args.world_sizes = [int(s) for s in args.world_sizes.split(",") if s.strip()]
    except ValueError:
        p.error(f"--world-sizes must list integers, got {args.world_sizes!r}")
    if not args.world_sizes or min(args.world_sizes) < 1:
        p.error("--world-sizes must list positive integers")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.bytes:
        rows = count_bytes(args)
        print(f"width {args.width}, {args.layers} layers, Ψ = {rows[0]['psi']:,} elements, "
              f"Muon's matrices Ψ_M = {rows[0]['psi_matrices']:,}; elements sent per rank in "
              "a steady step, ÷ Ψ\n")
        print("| ranks | stage | AdamW | Muon + AdamW | of which all-to-all | "
              "k·Ψ_M(N-1)/N² ÷ Ψ |")
        print("|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['world_size']} | {r['stage']} | {r['adamw_per_psi']:.3f} | "
                  f"{r['muon_per_psi']:.3f} | {r['all_to_all_per_psi']:.3f} | "
                  f"{r['formula_per_psi']:.3f} |")
        suite, config = "zero1-muon-bytes", {"width": args.width, "layers": args.layers}
    else:
        shapes = layer_shapes(args.width, args.layers)
        print(f"{len(shapes)} matrices, {sum(r * c for r, c in shapes):,} elements "
              f"(width {args.width}, {args.layers} layers) on {args.device}, torch "
              f"{torch.__version__}, {torch.get_num_threads()} threads; {args.rounds} rounds "
              f"of {args.window} steps\n")
        rows = time_steps(args)
        print("| variant | ms / step | AdamW ÷ variant (q1-q3) | NS GFLOP/step | GFLOP/s |")
        print("|---|---:|---:|---:|---:|")
        for r in rows:
            flop = (f"{r['ns_gflop']:.2f} | {r['ns_gflops_per_s']:.1f}" if "ns_gflop" in r
                    else "- | -")
            print(f"| {r['variant']} | {r['median_ms']:.2f} | {r['ratio']:.3f} "
                  f"({r['ratio_q1']:.3f}-{r['ratio_q3']:.3f}) | {flop} |")
        suite = "zero1-muon-step"
        config = {"width": args.width, "layers": args.layers, "device": args.device,
                  "rounds": args.rounds, "window": args.window}
    if args.out:
        from lab2bench.records import Recorder

        recorder = Recorder(args.out)
        for r in rows:
            recorder.record(suite, config, r)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
