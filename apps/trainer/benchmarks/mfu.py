"""MFU, step time and peak memory of real training steps on one GPU, beside ``lab2-train
plan``'s prediction for the same runs.

    python apps/trainer/benchmarks/mfu.py --configs xl:32x512 --profile
    python apps/trainer/benchmarks/mfu.py --configs medium:8x512 --stack torch
    python apps/trainer/benchmarks/mfu.py --configs xl:64x512:compiled:selective
    python apps/trainer/benchmarks/mfu.py --plan-check --out runs/plan-check
    python apps/trainer/benchmarks/mfu.py --out-of-sample --out runs/out-of-sample

A configuration is ``preset:BATCHxCONTEXT[:eager|compiled][:none|full|selective]`` (default
compiled, no activation checkpointing). Each builds the trainer's model and sets it up as the
trainer does (``harness.setup``) with ``--stack``: ``ours`` (tritonnorm + zero1's
ShardedOptimizer stage 1, the trainer's default), ``ours-zero2``, ``ours-allreduce``
(DDPBucketed 25 MB + ShardedOptimizer broadcasting), ``ours-zero3`` (zero1's stage 3),
``ours-fsdp`` (FSDP2), ``torch`` (``nn.RMSNorm`` +
DistributedDataParallel + ZeroRedundancyOptimizer) or ``none`` (no wrapper, plain AdamW), on
a one-rank group, bf16 autocast, fused AdamW. After ``--warmup`` steps (compilation,
AdamW's state) it times ``--windows`` windows of ``--steps`` back-to-back steps between CUDA
events and keeps the best (the machine's other work only slows a window down). It reports
ms/step, tokens/s, MFU and HFU (``lab2_trainer.reporting.report``),
``torch.cuda.max_memory_allocated``
over the timed steps, and the planner's peak and step time with their errors (predicted ÷
measured − 1). ``--plan-check`` runs the planner's check list unwrapped (``--stack none``,
one window of 5 steps), a configuration starting only while ``--budget-s`` (280) leaves it
time: under 5 minutes on an H200. ``--out-of-sample`` runs :data:`OUT_OF_SAMPLE`, the check
runs no planner constant was fitted to. ``--profile`` adds the device time per step by kernel
family; ``--device cpu`` runs the plumbing on a micro model (times only).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

import harness
import torch
import torch._dynamo

from lab2_trainer.config import ACTIVATION_CHECKPOINTING, BACKWARD_THREADS, PRESETS
from lab2_trainer.models.shapes import training_flops_per_token
from lab2_trainer.planner.plan import GIB, Hardware, PlanInput, plan
from lab2_trainer.reporting.report import (
    device_label,
    device_peak,
    matmul_parameters,
    mfu,
    recompute_flops_per_token,
)
from lab2bench.timing import measure as measure_time

STACKS = {  # norm (None: the preset's), the trainer's --ddp and --sharding
    "ours": ("tritonnorm", "none", "zero1"),
    "ours-zero2": ("tritonnorm", "none", "zero2"),
    "ours-allreduce": ("tritonnorm", "bucketed", "zero1-allreduce"),
    "ours-zero3": ("tritonnorm", "none", "zero3"),
    "ours-fsdp": ("tritonnorm", "none", "fsdp"),
    "torch": ("torch", "torch", "torch"),
    "none": (None, "none", "none"),
}
PLAN_CHECK = [
    "medium:8x512:eager:none", "medium:8x512:eager:full", "medium:8x512:eager:selective",
    "xl:8x512:eager:none", "xl:32x512:eager:full", "xl:32x512:compiled:none",
    "medium:32x512:compiled:none", "medium:32x512:compiled:selective",
]
#: Check runs no planner constant was fitted to, on configurations not measured when the
#: formulas were written: the planner's out-of-sample errors (README, planner section).
#: A run that a constant is later fitted to leaves this list.
OUT_OF_SAMPLE = ["large:16x1024:compiled:none", "2.7B:8x1024:eager:full",
                 "xl:64x512:compiled:selective"]
#: Seconds of --budget-s a configuration needs left to start (compiling takes a while).
NEEDS = {"eager": 15.0, "compiled": 90.0}
# Kernel families by name fragment, first match wins (cuBLAS's Hopper kernels are nvjet_*).
FAMILIES = [
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass")),
    ("attention", ("flash", "fmha", "sdpa", "attention", "dot_do_o", "convert_dq")),
    ("norm", ("_rows_kernel", "_sum_partials", "rms")),
    ("adamw", ("fusedopti", "adam")),
    ("nccl", ("nccl", "onerank")),
    ("inductor (fused elementwise)", ("triton_",)),
    ("copies and fills", ("memcpy", "memset", "copy", "fill")),
]
COLUMNS = ["config", "stack", "params_B", "step_ms", "tokens_per_s", "mfu", "hfu", "peak_GiB",
           "predicted_peak_GiB", "peak_error", "predicted_step_ms", "step_error"]


def parse_config(p: argparse.ArgumentParser, text: str) -> dict:
    parts = text.split(":")
    preset, shape, mode, kind = (parts + ["", "", "compiled", "none"][len(parts):])[:4]
    if len(parts) > 4:
        mode = ""
    batch, _, context = shape.partition("x")
    if preset not in PRESETS or mode not in NEEDS or kind not in ACTIVATION_CHECKPOINTING \
            or not batch.isdigit() or not context.isdigit() or min(int(batch), int(context)) < 1:
        p.error(f"bad configuration {text!r}: want preset:BATCHxCONTEXT[:eager|compiled]"
                "[:none|full|selective]")
    return dict(config=text, preset=preset, batch=int(batch), context=int(context), mode=mode,
                kind=kind)


def measure(cfg: dict, args: argparse.Namespace, device: torch.device) -> tuple[dict, dict]:
    """Time ``cfg`` (see the module docstring); returns its row's config and figures."""
    norm, ddp, sharding = STACKS[args.stack]
    cuda = device.type == "cuda"
    config = harness.build_config(cfg["preset"] if cuda else "micro", context_length=cfg["context"],
                                  vocab_size=args.vocab_size, norm=norm)
    start = time.perf_counter()
    model = harness.build_model(config, device, seed=0)
    model.activation_checkpointing = cfg["kind"]
    compiled = {"backend": "inductor", "mode": args.compile_mode} if cfg["mode"] == "compiled" \
        else None
    variant = harness.setup(model, sharding, device, ddp=ddp, compile=compiled)
    batches = [harness.random_batch(config, cfg["batch"], device, seed=i) for i in range(2)]

    def step(i: int) -> None:  # its marks go unread
        harness.step_marks(variant, batches[i % 2], "bf16", device, args.backward_thread)

    for i in range(args.warmup):
        step(i)
    harness.free_memory(device)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    # Windows of back-to-back steps between CUDA events (wall time on the CPU).
    windows = [s / args.steps for s in measure_time(
        lambda: [step(i) for i in range(args.steps)], warmup=0, repeats=args.windows,
        device=device).samples]
    step_s = min(windows)
    setup_s = time.perf_counter() - start - sum(windows) * args.steps
    tokens_per_s = cfg["batch"] * config.context_length / step_s
    flops = training_flops_per_token(config, matmul_parameters(model))
    peak = device_peak(device)
    hardware = Hardware(peak_tflops=peak.flops / 1e12) if peak else Hardware()
    predicted = plan(PlanInput(config, batch_size=cfg["batch"], precision="bf16",
                               sharding=sharding, ddp=ddp, activation_checkpointing=cfg["kind"],
                               compile=compiled is not None, hardware=hardware))
    figures = {
        "params_B": predicted["parameters"] / 1e9, "step_ms": step_s * 1e3,
        "windows_ms": [w * 1e3 for w in windows], "setup_s": setup_s,
        "tokens_per_s": tokens_per_s, "mfu": mfu(tokens_per_s, flops, peak),
        "hfu": mfu(tokens_per_s, flops + recompute_flops_per_token(config, cfg["kind"]), peak),
        "peak_GiB": torch.cuda.max_memory_allocated() / GIB if cuda else None,
        "predicted_peak_GiB": predicted["peak_gib"],
        "predicted_step_ms": predicted["time"]["step_s"] * 1e3}
    figures["step_error"] = figures["predicted_step_ms"] / figures["step_ms"] - 1
    if cuda:
        figures["peak_error"] = figures["predicted_peak_GiB"] / figures["peak_GiB"] - 1
    if args.profile:
        figures["device_ms_by_family"] = profile(step)
    return {"config": cfg["config"], "stack": args.stack, "device": device_label(device),
            "warmup": args.warmup, "steps": args.steps, "windows": args.windows}, figures


def profile(step) -> dict[str, float]:
    """Device ms per step by kernel family (two profiled steps); printed, and returned."""
    from torch.profiler import ProfilerActivity

    with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(2):
            step(i)
        torch.cuda.synchronize()
    by_family: collections.Counter = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            low = event.name.lower()
            name = next((n for n, frags in FAMILIES if any(f in low for f in frags)), "other")
            by_family[name] += getattr(event, "device_time", None) or 0.0
    total = sum(by_family.values())
    print(f"device time per step, by kernel family ({total / 2e3:.1f} ms):")
    for name, us in by_family.most_common():
        print(f"  {name:30s} {us / 2e3:8.2f} ms  {100 * us / total:5.1f}%")
    return {name: us / 2e3 for name, us in by_family.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=None,
                   help="preset:BATCHxCONTEXT[:eager|compiled][:none|full|selective] ... "
                        "(default medium:8x512, or the plan check's list)")
    p.add_argument("--stack", choices=list(STACKS), default=None,
                   help="default ours (none with --plan-check)")
    p.add_argument("--plan-check", action="store_true",
                   help="the planner's check list, unwrapped, one window of 5 steps")
    p.add_argument("--out-of-sample", action="store_true",
                   help="the planner's out-of-sample check runs (OUT_OF_SAMPLE), default stack")
    p.add_argument("--vocab-size", type=int, default=10000)
    p.add_argument("--compile-mode", default=None, help="torch.compile mode")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (compile in them)")
    p.add_argument("--steps", type=int, default=None, help="steps per window (default 8; 5)")
    p.add_argument("--windows", type=int, default=None, help="timed windows (default 3; 1)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start a configuration only if it should end within this many seconds "
                        "of the start (default none; 280 with --plan-check)")
    p.add_argument("--profile", action="store_true", help="device time by kernel family")
    p.add_argument("--backward-thread", choices=BACKWARD_THREADS, default="caller")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: the plumbing on a micro model (times only)")
    p.add_argument("--out", default=None, help="folder for mfu.jsonl and mfu.md")
    args = p.parse_args(argv)
    check = args.plan_check
    args.stack = args.stack or ("none" if check else "ours")
    args.steps = args.steps or (5 if check else 8)
    args.windows = args.windows or (1 if check else 3)
    args.budget_s = args.budget_s or (280.0 if check else float("inf"))
    default = PLAN_CHECK if check else OUT_OF_SAMPLE if args.out_of_sample else ["medium:8x512"]
    configs = [parse_config(p, c) for c in args.configs or default]
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA GPU (--device cpu runs the plumbing on a micro model)")
    device = harness.single_rank_group(args.device == "cuda")
    out = harness.Output("mfu", args.out)
    start = time.perf_counter()
    for cfg in configs:
        if time.perf_counter() - start + NEEDS[cfg["mode"]] > args.budget_s:
            print(f"skipped {cfg['config']}: it would end past --budget-s {args.budget_s:g}",
                  file=sys.stderr)
            continue
        try:
            out.add(*measure(cfg, args, device))
        except torch.OutOfMemoryError:
            out.add({"config": cfg["config"], "stack": args.stack}, {"error": "out of memory"})
        finally:
            harness.free_memory(device)
            torch._dynamo.reset()
        print({k: v for k, v in out.rows[-1].items() if k in COLUMNS or k == "error"},
              flush=True)
    torch.distributed.destroy_process_group()
    out.table(COLUMNS, f"one {device_label(device)}, bf16, vocabulary {args.vocab_size}, best "
                       f"of {args.windows} window(s) of {args.steps} steps after {args.warmup}")
    out.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
