"""Suite ``stack``: tokens/s of our stack against PyTorch's, same model, data and seed.

    ours     DDPBucketed (25 MB buckets) + ShardedOptimizer(AdamW) + tritonnorm RMSNorm.
    pytorch  DistributedDataParallel + ZeroRedundancyOptimizer(AdamW) + torch.nn.RMSNorm
             (the reference RMSNorm where this torch has no nn.RMSNorm).

Both models start from the same weights (norm weights are ones in all three norms). Run on
2 Gloo ranks on the CPU (``--world-size 2``) and on one GPU in bf16 (``--device cuda
--world-size 1 --precision bf16``).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn

from lab2_trainer.bench.distributed import (
    RankSpec,
    Variant,
    add_rank_arguments,
    base_model,
    fresh_copy,
    launch,
    measure_variants,
    rank_batches,
    rank_device,
    rank_spec,
    summarize,
)
from lab2_trainer.bench.report import SuiteOutput

NAME = "stack"
HELP = ("tokens/s: DDPBucketed + ShardedOptimizer + tritonnorm vs DistributedDataParallel + "
        "ZeroRedundancyOptimizer + torch RMSNorm")
KINDS = ("ours", "pytorch")
LR, WEIGHT_DECAY = 1e-4, 0.1
COLUMNS = ["preset", "variant", "norm", "world_size", "precision", "step_ms", "step_std_ms",
           "tokens_per_s", "ratio_to_pytorch"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_rank_arguments(parser)
    parser.add_argument("--bucket-mb", type=float, default=25.0,
                        help="DDPBucketed's bucket size (default 25, PyTorch DDP's default)")


def pytorch_norm() -> str:
    return "torch" if hasattr(nn, "RMSNorm") else "reference"


def run(args: argparse.Namespace, out: SuiteOutput) -> None:
    if args.norm is not None:
        raise SystemExit("lab2-train bench stack: the norms are part of each stack; "
                         "drop --norm")
    for preset in args.presets:
        spec = rank_spec(args, preset, list(KINDS), bucket_mb=args.bucket_mb)
        per_rank = launch(stack_rank, args, spec)
        summary = {n: summarize(per_rank, n) for n in KINDS}
        tokens = args.world_size * args.batch_size * args.context_length
        ref = tokens / (summary["pytorch"]["step_ms"] / 1e3)
        for name in KINDS:
            s = summary[name]
            tps = tokens / (s["step_ms"] / 1e3)
            conf = {"preset": preset, "params_M": per_rank[0]["params"] / 1e6, "variant": name,
                    "norm": "tritonnorm" if name == "ours" else pytorch_norm(),
                    "world_size": args.world_size, "device": args.device,
                    "precision": args.precision, "batch_size": args.batch_size,
                    "context_length": args.context_length, "steps": args.steps,
                    "rounds": args.rounds, "bucket_mb": args.bucket_mb}
            out.add(conf, {**s, "tokens_per_s": tps, "ratio_to_pytorch": tps / ref})
    out.table(COLUMNS, title=f"stack: {args.world_size} ranks, {args.device}, batch "
                             f"{args.batch_size}/rank x context {args.context_length}")


def build_variant(name: str, bases: dict[str, nn.Module], device: torch.device,
                  spec: RankSpec) -> Variant:
    model = fresh_copy(bases[name], device)
    if name == "ours":
        from minddp import DDPBucketed
        from zero1 import ShardedOptimizer

        wrapper = DDPBucketed(model, bucket_size_mb=spec.extra["bucket_mb"])
        optimizer = ShardedOptimizer(list(model.parameters()), torch.optim.AdamW, lr=LR,
                                     weight_decay=WEIGHT_DECAY)
        return Variant(model, wrapper, optimizer, sync=wrapper.finish_gradient_synchronization)
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    wrapper = DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=spec.extra["bucket_mb"])
    optimizer = ZeroRedundancyOptimizer(list(model.parameters()),
                                        optimizer_class=torch.optim.AdamW, lr=LR,
                                        weight_decay=WEIGHT_DECAY)
    return Variant(model, wrapper, optimizer)


def stack_rank(rank: int, world_size: int, spec: RankSpec) -> dict[str, Any]:
    """One rank of the ``stack`` suite."""
    device = rank_device()
    bases = {"ours": base_model(spec, norm="tritonnorm"),
             "pytorch": base_model(spec, norm=pytorch_norm())}
    batches = rank_batches(bases["ours"], spec, rank, device)
    results = measure_variants(rank, spec, lambda n: build_variant(n, bases, device, spec),
                               lambda n: batches)
    results["params"] = sum(p.numel() for p in bases["ours"].parameters())
    return results
