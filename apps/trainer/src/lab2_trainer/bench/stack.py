"""Suite ``stack``: tokens/s of our stack against PyTorch's, same model, data and seed,
with every sharding kind of each side by side (``bench.arguments.STACKS``):

    ours               tritonnorm RMSNorm + ``--sharding zero1`` (zero1's stage 1 reduces
                       the gradients itself: the trainer's default on several ranks).
    ours-zero2         the same with stage 2.
    ours-allreduce     DDPBucketed (25 MB buckets) + ShardedOptimizer broadcasting its
                       shards (``--sharding zero1-allreduce``).
    ours-fsdp          tritonnorm + PyTorch's FSDP2.
    pytorch            DistributedDataParallel + ZeroRedundancyOptimizer(AdamW) +
                       torch.nn.RMSNorm (the reference RMSNorm where this torch has none).
    pytorch-fsdp(-keep) torch.nn.RMSNorm + FSDP2, ``reshard_after_forward`` True / False.

All models start from the same weights (norm weights are ones in all three norms). Run on
2 Gloo ranks on the CPU (``--world-size 2``) and on one GPU in bf16 (``--device cuda
--world-size 1 --precision bf16``).

Every stack is set up by the trainer's own ``parallelize``, so each steps the trainer's
AdamW (decay and no-decay groups, fused kernels on CUDA). With ``--compile`` every model is
compiled as the trainer compiles: the bare model goes through ``torch.compile`` and the DDP
wrapper, zero1's hooks or FSDP2's wrap or hook the bare model, so they run around the
compiled graphs. ``mfu`` is the model FLOPs utilisation per GPU (``lab2_trainer.report``),
empty where no peak is known.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn

from lab2_trainer.bench.arguments import STACKS
from lab2_trainer.bench.distributed import (
    RankSpec,
    Variant,
    base_model,
    fresh_copy,
    launch,
    make_sharded_variant,
    measure_variants,
    rank_batches,
    rank_device,
    rank_spec,
    summarize,
    thread_label,
    timing_label,
)
from lab2_trainer.bench.e2e import mfu_note
from lab2_trainer.report import device_peak, matmul_parameters, mfu, training_flops_per_token
from lab2bench.suites import SuiteOutput

COLUMNS = ["preset", "variant", "norm", "sharding", "world_size", "precision", "compiled",
           "step_ms", "step_std_ms", "tokens_per_s", "mfu", "ratio_to_pytorch", "step_vs_first"]


def pytorch_norm() -> str:
    return "torch" if hasattr(nn, "RMSNorm") else "reference"


def run(args: argparse.Namespace, out: SuiteOutput) -> None:
    if args.norm is not None:
        raise SystemExit("lab2-train bench stack: the norms are part of each stack; "
                         "drop --norm")
    kinds = list(args.variants)
    bad = [k for k in kinds if k not in STACKS]
    if bad:
        raise SystemExit(f"lab2-train bench stack: unknown variant(s) {', '.join(bad)} "
                         f"(from {', '.join(STACKS)})")
    compile_spec = None
    if args.compile:
        compile_spec = {"backend": args.backend or ("aot_eager" if args.quick else "inductor"),
                        "mode": args.compile_mode}
        # Compilation happens in the first calls: keep at least two of them untimed.
        args.warmup = max(args.warmup, 2)
    peak = device_peak(args.device)
    for preset in args.presets:
        spec = rank_spec(args, preset, kinds, bucket_mb=args.bucket_mb,
                         bucket_rule=args.bucket_rule, compile=compile_spec)
        per_rank = launch(stack_rank, args, spec)
        summary = {n: summarize(per_rank, n) for n in kinds}
        tokens = args.world_size * args.batch_size * args.context_length
        ref_name = "pytorch" if "pytorch" in kinds else kinds[0]
        ref = tokens / (summary[ref_name]["step_ms"] / 1e3)
        for name in kinds:
            s = summary[name]
            tps = tokens / (s["step_ms"] / 1e3)
            conf = {"preset": preset, "params_M": per_rank[0]["params"] / 1e6, "variant": name,
                    "norm": norm_of(name), "sharding": STACKS[name][1],
                    "world_size": args.world_size, "device": args.device,
                    "precision": args.precision, "batch_size": args.batch_size,
                    "context_length": args.context_length, "steps": args.steps,
                    "rounds": args.rounds, "bucket_mb": args.bucket_mb,
                    "compiled": compile_label(compile_spec), "timing": timing_label(args),
                    "backward_thread": args.backward_thread, "bucket_rule": args.bucket_rule}
            util = mfu(tps, per_rank[0]["flops_per_token"], peak, devices=args.world_size)
            # step_vs_first: the step over the first stack's (by default "ours").
            out.add(conf, {**s, "tokens_per_s": tps, "mfu": util, "ratio_to_pytorch": tps / ref,
                           "step_vs_first": s["step_ms"] / summary[kinds[0]]["step_ms"]})
    out.table(COLUMNS, title=f"stack: {args.world_size} ranks, {args.device}, batch "
                             f"{args.batch_size}/rank x context {args.context_length}, steps "
                             f"timed {timing_label(args)}, {thread_label(args)}")
    out.note(mfu_note(args.device))


def compile_label(compile_spec: dict | None) -> str:
    """How the models were compiled, for the table: "no", or the backend (and mode)."""
    if compile_spec is None:
        return "no"
    mode = f", {compile_spec['mode']}" if compile_spec["mode"] else ""
    return f"{compile_spec['backend']}{mode}"


def norm_of(name: str) -> str:
    """The norm layer stack ``name`` trains with."""
    return "tritonnorm" if STACKS[name][0] == "ours" else pytorch_norm()


def build_variant(name: str, bases: dict[str, nn.Module], device: torch.device,
                  spec: RankSpec) -> Variant:
    """A fresh copy of stack ``name``'s model, set up by the trainer's ``parallelize``."""
    side, sharding, ddp = STACKS[name]
    return make_sharded_variant(fresh_copy(bases[side], device), sharding, device,
                                compile=spec.extra.get("compile"), ddp=ddp,
                                bucket_mb=spec.extra["bucket_mb"],
                                bucket_rule=spec.extra["bucket_rule"])


def stack_rank(rank: int, world_size: int, spec: RankSpec) -> dict[str, Any]:
    """One rank of the ``stack`` suite."""
    device = rank_device()
    if spec.extra.get("compile") is not None:
        import torch._dynamo

        # Every round compiles fresh copies of two models; do not let the default cache
        # limit (8 entries per code object) send later rounds back to eager.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    bases = {"ours": base_model(spec, norm="tritonnorm"),
             "pytorch": base_model(spec, norm=pytorch_norm())}
    batches = rank_batches(bases["ours"], spec, rank, device)
    results = measure_variants(rank, spec, lambda n: build_variant(n, bases, device, spec),
                               lambda n: batches)
    results["params"] = sum(p.numel() for p in bases["ours"].parameters())
    results["flops_per_token"] = training_flops_per_token(bases["ours"].config,
                                                          matmul_parameters(bases["ours"]))
    return results
