"""Tokens/s of our stack against PyTorch's, same model, data and seed, N local ranks.

    python apps/trainer/benchmarks/stack.py --quick
    python apps/trainer/benchmarks/stack.py --device cuda --world-size 1 --precision bf16 \\
        --preset small,medium --batch-size 8 --context-length 512 [--compile]
    python apps/trainer/benchmarks/stack.py --device cuda --world-size 1 --precision bf16 \
        --preset xl --batch-size 32 --context-length 512 --compile \
        --variants ours-zero3,ours-fsdp,ours-fsdp#2  # zero3 beside FSDP2 and its A/A control

Stacks (norm layer, ``harness.SHARDINGS`` kind, DDP wrapper): ``ours`` (tritonnorm +
``--sharding zero1``, the trainer's default on several ranks), ``ours-zero2``,
``ours-allreduce`` (DDPBucketed + ShardedOptimizer broadcasting its shards), ``ours-zero3``
(zero1's stage 3, ``reshard_after_forward`` True), ``ours-fsdp``,
``pytorch`` (``nn.RMSNorm`` + DistributedDataParallel + ZeroRedundancyOptimizer),
``pytorch-fsdp`` and ``pytorch-fsdp-keep`` (FSDP2, ``reshard_after_forward`` True / False).
Each is set up by the trainer's ``parallelize``; with ``--compile`` every model is compiled as
the trainer compiles it (block by block, the wrapper or hooks around the compiled graphs).
``mfu`` is per GPU, empty where no peak is known.
"""

from __future__ import annotations

from typing import Any

import harness
from torch import nn

from lab2_trainer.models.shapes import training_flops_per_token
from lab2_trainer.reporting.report import device_peak, matmul_parameters, mfu

STACKS: dict[str, tuple[str, str, str | None]] = {
    "ours": ("ours", "zero1", None),
    "ours-zero2": ("ours", "zero2", None),
    "ours-allreduce": ("ours", "zero1-allreduce", "bucketed"),
    "ours-zero3": ("ours", "zero3", None),
    "ours-fsdp": ("ours", "fsdp", None),
    "pytorch": ("pytorch", "torch_zero", "torch"),
    "pytorch-fsdp": ("pytorch", "fsdp", None),
    "pytorch-fsdp-keep": ("pytorch", "fsdp-keep", None),
}
COLUMNS = ["preset", "variant", "norm", "sharding", "world_size", "precision", "compiled",
           "step_ms", "step_std_ms", "tokens_per_s", "mfu", "ratio_to_pytorch", "step_vs_first"]


def norm_of(side: str) -> str:
    return "tritonnorm" if side == "ours" else "torch" if hasattr(nn, "RMSNorm") else "reference"


def stack_rank(rank: int, world_size: int, spec: harness.RankSpec) -> dict[str, Any]:
    device = harness.rank_device()
    if spec.compile is not None:
        import torch._dynamo

        # Every round compiles fresh copies: keep later rounds from falling back to eager.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    bases = {side: harness.base_model(spec, norm=norm_of(side)) for side in ("ours", "pytorch")}

    def build(name: str):
        side, kind, ddp = STACKS[harness.kind_of(name)]
        sharding, kind_ddp, reshard = harness.SHARDINGS[kind]
        return harness.setup(harness.fresh_copy(bases[side], device), sharding, device,
                             ddp=ddp if ddp and kind_ddp != "none" else kind_ddp,
                             reshard=reshard, compile=spec.compile,
                             bucket_mb=spec.bucket_mb,
                             bucket_rule=spec.bucket_rule)

    results = harness.measure_variants(rank, spec, build,
                                       harness.rank_batches(bases["ours"], spec, rank, device))
    results["params"] = sum(p.numel() for p in bases["ours"].parameters())
    results["flops_per_token"] = training_flops_per_token(bases["ours"].config,
                                                          matmul_parameters(bases["ours"]))
    return results


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__.split("\n\n")[0], ranks=True)
    p.add_argument("--variants", type=harness.split, default=list(STACKS),
                   help=f"comma-separated, from {', '.join(STACKS)}")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDPBucketed's bucket size")
    p.add_argument("--bucket-rule", default="reach", choices=("reach", "at_most"))
    p.add_argument("--compile", action="store_true", help="torch.compile every model")
    p.add_argument("--backend", default=None,
                   help="torch.compile backend (default inductor; aot_eager with --quick)")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode")
    args = harness.parse(p, argv)
    kinds = harness.check_names(p, "variant", args.variants, STACKS)
    if args.norm is not None:
        p.error("the norms are part of each stack; drop --norm")
    compile_spec = None
    if args.compile:
        compile_spec = {"backend": args.backend or ("aot_eager" if args.quick else "inductor"),
                        "mode": args.compile_mode}
        args.warmup = max(args.warmup, 2)  # the first calls compile
    compiled = "no" if compile_spec is None else ", ".join(filter(None, compile_spec.values()))
    out = harness.Output("stack", args.out)
    for preset in args.presets:
        spec = harness.rank_spec(args, preset, kinds, compile=compile_spec)
        per_rank = harness.launch(stack_rank, args, spec)
        summary = {n: harness.summarize(per_rank, n) for n in kinds}
        tokens = args.world_size * args.batch_size * args.context_length
        ref_ms = summary["pytorch" if "pytorch" in kinds else kinds[0]]["step_ms"]
        for name in kinds:
            s = summary[name]
            tps = tokens / (s["step_ms"] / 1e3)
            side, sharding, _ = STACKS[harness.kind_of(name)]
            out.add({"preset": preset, "params_M": per_rank[0]["params"] / 1e6,
                     "variant": name, "norm": norm_of(side), "sharding": sharding,
                     **harness.labels(args),
                     "bucket_mb": args.bucket_mb, "compiled": compiled,
                     "bucket_rule": args.bucket_rule},
                    {**s, "tokens_per_s": tps, "ratio_to_pytorch": ref_ms / s["step_ms"],
                     "mfu": mfu(tps, per_rank[0]["flops_per_token"], device_peak(args.device),
                                devices=args.world_size),
                     "step_vs_first": s["step_ms"] / summary[kinds[0]]["step_ms"]})
    out.table(COLUMNS, harness.title("stack", args))
    out.note(harness.mfu_note(args.device))
    out.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
