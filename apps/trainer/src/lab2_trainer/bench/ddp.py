"""Suite ``ddp``: minddp's data-parallel variants against PyTorch's DistributedDataParallel.

All variants run in one launch of N ranks (same model, data and seed; interleaved rounds),
each timing a full training step: forward, backward, gradient synchronisation, AdamW step.
Each variant is the trainer's own ``GradSync`` (``lab2_trainer.parallel``; its kind in
brackets below) and the trainer's AdamW (``build_optimizer``), so the suite measures the
code that trains.

Variants:
    local       [none] no communication at all (each rank trains on its slice alone): the
                baseline that communication is measured against.
    naive       [naive] ``all_reduce_gradients(model)``: one all-reduce per parameter, after
                backward.
    flat        [flat] ``all_reduce_gradients(model, flat=True)``: one all-reduce of
                everything.
    individual  [individual] ``DDPIndividualParameters``: an async all-reduce per gradient as
                it is ready.
    bucketed:MB [bucketed] ``DDPBucketed(bucket_size_mb=MB)``: async all-reduce per bucket.
    torch       [torch] ``torch.nn.parallel.DistributedDataParallel`` (``--torch-bucket-mb``,
                default 25 MB buckets).
    bucketed_bf16:MB  [bucketed, reduce_dtype bfloat16] ``DDPBucketed(bucket_size_mb=MB,
                reduce_dtype=torch.bfloat16)``: gradients travel and are averaged in bfloat16.
    torch_bf16  [torch, reduce_dtype bfloat16] PyTorch DDP with its ``bf16_compress_hook``
                (the same idea, PyTorch's way).

Exposed communication, two ways (both reported):
    sync wait   time from the end of ``loss.backward()`` to the end of the synchronisation
                call (``finish_gradient_synchronization`` or the post-backward all-reduce):
                communication that backward did not hide. PyTorch DDP waits for its buckets
                inside ``backward()``, so its sync wait is 0 by construction.
    vs local    the variant's step time minus the ``local`` variant's, measured in the same
                run on the same ranks: everything communication (and its bookkeeping) adds
                to a step. This is the figure comparable across all variants, PyTorch DDP's
                included.
On CUDA with ``--trace``, a profiler trace of one extra step per variant also gives the
share of NCCL kernel time that ran while compute kernels were running (hidden under
backward): ``overlap_share``; and the NCCL time that ran under no compute kernel, over the
mean step time: ``nccl_exposed_share`` (communication exposed by the trace's measure; the
"vs local" figure also counts compute slowed down by NCCL running beside it).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
from torch import nn

from lab2_trainer.bench.arguments import DDP_VARIANTS
from lab2_trainer.bench.distributed import (
    RankSpec,
    Variant,
    base_model,
    fresh_copy,
    launch,
    make_variant,
    measure_variants,
    rank_batches,
    rank_device,
    rank_spec,
    run_step,
    summarize,
    thread_label,
    timing_label,
)
from lab2_trainer.bench.trace_overlap import nccl_overlap
from lab2bench.suites import SuiteOutput

DEFAULT_BUCKETS = [1.0, 5.0, 25.0, 100.0]
SWEEP_BUCKETS = [1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 500.0]
BUCKETED_KINDS = ("bucketed", "bucketed_bf16")  # run once per bucket size
COLUMNS = ["preset", "variant", "step_ms", "step_std_ms", "ratio_to_torch", "backward_ms",
           "sync_wait_ms", "sync_wait_share", "overhead_vs_local_ms", "exposed_share_vs_local"]


def variant_names(args: argparse.Namespace) -> list[str]:
    bad = [k for k in args.variants if k not in DDP_VARIANTS]
    if bad:
        raise SystemExit(f"lab2-train bench ddp: unknown variant(s) {', '.join(bad)}; "
                         f"choose from {', '.join(DDP_VARIANTS)}")
    buckets = SWEEP_BUCKETS if args.sweep else (args.bucket_mb or DEFAULT_BUCKETS)
    if any(b <= 0 for b in buckets):
        raise SystemExit("lab2-train bench ddp: bucket sizes must be > 0")
    names: list[str] = []
    for kind in args.variants:
        if kind in BUCKETED_KINDS:
            names.extend(f"{kind}:{b:g}" for b in buckets)
        else:
            names.append(kind)
    return names


def run(args: argparse.Namespace, out: SuiteOutput) -> None:
    if args.world_size < 1:
        raise SystemExit("lab2-train bench ddp: --world-size must be >= 1")
    names = variant_names(args)
    trace_dir = os.path.abspath(os.path.join(args.out, "traces")) if (args.trace and args.out) \
        else None
    for preset in args.presets:
        spec = rank_spec(args, preset, names, torch_bucket_mb=args.torch_bucket_mb,
                         bucket_rule=args.bucket_rule,
                         trace_dir=trace_dir, trace=args.trace)
        per_rank = launch(ddp_rank, args, spec)
        add_rows(out, args, preset, names, per_rank)
    out.table(COLUMNS + (["overlap_share", "nccl_exposed_share"] if args.trace else []),
              title=f"ddp: {args.world_size} ranks, {args.device}, {args.precision}, batch "
                    f"{args.batch_size}/rank x context {args.context_length}, "
                    f"{args.steps} timed steps x {args.rounds} rounds, steps timed "
                    f"{timing_label(args)}, {thread_label(args)}")
    out.note(METHOD)
    sweep = [r for r in out.rows if r["bucket_mb"] is not None]
    out.plot("bucket-sweep", x="bucket_mb", y="step_ms", series="preset", rows=sweep,
             logx=True)


METHOD = (
    "Exposed communication: `sync_wait` = end of backward -> end of the synchronisation call "
    "(finish_gradient_synchronization / post-backward all-reduce), per rank, averaged; "
    "`overhead_vs_local` = step time minus that of `local` (same ranks, same run, no "
    "communication), which also covers PyTorch DDP, whose backward() waits for its buckets. "
    "Shares are of the variant's own step time. Step time = slowest rank per step, mean over "
    "steps and rounds."
)


def add_rows(out: SuiteOutput, args: argparse.Namespace, preset: str, names: list[str],
             per_rank: list[dict[str, Any]]) -> None:
    summary = {name: summarize(per_rank, name) for name in names}
    torch_ms = summary["torch"]["step_ms"] if "torch" in summary else None
    local_ms = summary["local"]["step_ms"] if "local" in summary else None
    params = per_rank[0]["params"]
    for name in names:
        s = summary[name]
        overhead = s["step_ms"] - local_ms if local_ms is not None else None
        overlap = [r["overlap"].get(name) for r in per_rank if r.get("overlap")]
        overlap = [o for o in overlap if o is not None]
        conf = {"preset": preset, "params_M": params / 1e6, "variant": name,
                "bucket_mb": float(name.split(":")[1]) if ":" in name else None,
                "world_size": args.world_size, "device": args.device,
                "precision": args.precision, "batch_size": args.batch_size,
                "context_length": args.context_length, "steps": args.steps,
                "rounds": args.rounds, "warmup": args.warmup,
                "timing": timing_label(args), "backward_thread": args.backward_thread,
                "bucket_rule": args.bucket_rule}
        metrics = {
            **s,
            "ratio_to_torch": s["step_ms"] / torch_ms if torch_ms else None,
            "sync_wait_share": s["sync_wait_ms"] / s["step_ms"] if s["step_ms"] > 0 else None,
            "overhead_vs_local_ms": overhead,
            "exposed_share_vs_local": (max(0.0, overhead) / s["step_ms"]
                                       if overhead is not None and s["step_ms"] > 0 else None),
            "overlap_share": (sum(o["hidden_share"] for o in overlap) / len(overlap)
                              if overlap else None),
            # NCCL time of the traced step that ran under no compute kernel, over the
            # (untraced) mean step time: communication left exposed, from the trace.
            "nccl_exposed_share": (sum(o["nccl_ms"] - o["hidden_ms"] for o in overlap)
                                   / len(overlap) / s["step_ms"]
                                   if overlap and s["step_ms"] > 0 else None),
        }
        out.add(conf, metrics)


#: The ``GradSync`` kind of each variant (``bucketed`` and ``bucketed_bf16`` take their bucket
#: size from the variant's name, ``bucketed:25``).
DDP_KIND = {"local": "none", "naive": "naive", "flat": "flat", "individual": "individual",
            "bucketed": "bucketed", "torch": "torch", "bucketed_bf16": "bucketed",
            "torch_bf16": "torch"}


def build_variant(name: str, base: nn.Module, device: torch.device, spec: RankSpec) -> Variant:
    """A fresh copy of the model with the trainer's ``GradSync`` of variant ``name`` and the
    trainer's (unsharded) AdamW."""
    kind, _, mb = name.partition(":")
    if kind not in DDP_KIND or (kind in BUCKETED_KINDS) != bool(mb):
        raise ValueError(f"unknown ddp variant {name!r}")
    bucket_mb = float(mb) if mb else spec.extra["torch_bucket_mb"]
    reduce_dtype = torch.bfloat16 if kind.endswith("_bf16") else None
    return make_variant(fresh_copy(base, device), DDP_KIND[kind], "none", device,
                        bucket_mb=bucket_mb, reduce_dtype=reduce_dtype,
                        bucket_rule=spec.extra["bucket_rule"])


def ddp_rank(rank: int, world_size: int, spec: RankSpec) -> dict[str, Any]:
    """One rank of the ``ddp`` suite: every variant, interleaved rounds."""
    device = rank_device()
    base = base_model(spec)
    batches = rank_batches(base, spec, rank, device)
    overlap: dict[str, Any] = {}

    def after(name: str, v: Variant, rnd: int) -> None:
        if spec.extra.get("trace") and rnd == spec.rounds - 1:
            overlap[name] = traced_step(name, v, batches[0], spec, rank, device)

    results = measure_variants(rank, spec, lambda n: build_variant(n, base, device, spec),
                               lambda n: batches, after_variant=after)
    results["params"] = sum(p.numel() for p in base.parameters())
    results["overlap"] = overlap
    return results


def traced_step(name: str, v: Variant, batch: Any, spec: RankSpec, rank: int,
                device: torch.device) -> dict[str, float] | None:
    """Profile one step; save its Chrome trace; on CUDA return the NCCL/compute overlap."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    dist.barrier()
    with profile(activities=activities) as prof:
        run_step(v, batch, spec.precision, device, spec.backward_thread)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    trace_dir = spec.extra.get("trace_dir")
    if trace_dir is None:
        import tempfile

        trace_dir = tempfile.mkdtemp(prefix="lab2-bench-trace-")
    os.makedirs(trace_dir, exist_ok=True)
    path = os.path.join(trace_dir, f"{spec.preset}-{name.replace(':', '-')}-rank{rank}.json")
    prof.export_chrome_trace(path)
    return nccl_overlap(path) if device.type == "cuda" else None
