"""Model FLOPs utilisation of one training stack on one GPU, compiled, at a chosen batch.

Builds the trainer's model and sets it up, compiled, as the trainer does (``parallelize``,
through ``harness.setup``), times training steps
with CUDA events and prints tokens/s and MFU
(``lab2_trainer.mfu``: 6·N + attention FLOPs per token over the GPU's dense bf16 peak).
``--profile`` adds the device time per step by kernel family (matrix products,
attention, the norm, AdamW, NCCL, the rest), the way to see what is left to win.

    python apps/trainer/benchmarks/mfu.py --preset xl --batch-size 32
    python apps/trainer/benchmarks/mfu.py --preset medium --batch-size 8 --stack torch --profile

``--stack ours`` is zero1's ShardedOptimizer stage 1 (reducing the gradients itself) +
tritonnorm, the trainer's default; ``ours-zero2`` its stage 2; ``ours-allreduce``
DDPBucketed (25 MB) + ShardedOptimizer broadcasting (the default before zero1 0.3.0);
``--stack torch`` is DistributedDataParallel + ZeroRedundancyOptimizer + nn.RMSNorm. Both
run on a one-rank NCCL group, fused AdamW, bf16 autocast. Each timed window is
``--steps`` steps between two CUDA events; the best of ``--windows`` windows is reported
(the machine's other work only ever slows a window down).
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile
import time

import harness
import torch
import torch.distributed as dist

from lab2_trainer.mfu import (
    device_label,
    device_peak,
    matmul_parameters,
    mfu,
    recompute_flops_per_token,
    training_flops_per_token,
)
from lab2_trainer.settings import ACTIVATION_CHECKPOINTING, BACKWARD_THREADS

STACKS = {  # norm, ddp kind, sharding (the trainer's --ddp and --sharding)
    "ours": ("tritonnorm", "none", "zero1"),
    "ours-zero2": ("tritonnorm", "none", "zero2"),
    "ours-allreduce": ("tritonnorm", "bucketed", "zero1-allreduce"),
    "torch": ("torch", "torch", "torch"),
}
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


def family(kernel_name: str) -> str:
    low = kernel_name.lower()
    for name, fragments in FAMILIES:
        if any(f in low for f in fragments):
            return name
    return "other"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="medium")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--context-length", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=10000)
    p.add_argument("--stack", choices=sorted(STACKS), default="ours")
    p.add_argument("--mode", default=None, help="torch.compile mode (default: default)")
    p.add_argument("--steps", type=int, default=8, help="steps per timed window")
    p.add_argument("--windows", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="device time by kernel family")
    p.add_argument("--activation-checkpointing", choices=ACTIVATION_CHECKPOINTING,
                   default="none", help="recompute in backward (default none); HFU is "
                   "printed beside MFU")
    p.add_argument("--backward-thread", choices=BACKWARD_THREADS, default="caller",
                   help="the thread that runs backward (default caller, as the trainer does)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("mfu.py needs a CUDA GPU")
    norm, ddp, sharding = STACKS[args.stack]
    store = os.path.join(tempfile.mkdtemp(), "rendezvous")
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    config = harness.build_config(args.preset, context_length=args.context_length,
                                  vocab_size=args.vocab_size, norm=norm)
    model = harness.build_model(config, device, seed=0)
    model.activation_checkpointing = args.activation_checkpointing
    variant = harness.setup(model, sharding, device, ddp=ddp,
                            compile={"backend": "inductor", "mode": args.mode})
    batches = [harness.random_batch(config, args.batch_size, device, seed=i) for i in range(2)]

    def step(i: int) -> None:
        # its marks go unread
        harness.step_marks(variant, batches[i % 2], "bf16", device, args.backward_thread)

    start = time.perf_counter()
    for i in range(3):  # compiles in the first calls
        step(i)
    torch.cuda.synchronize()
    print(f"compile and warm-up: {time.perf_counter() - start:.0f} s")
    windows = []
    for _ in range(args.windows):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for i in range(args.steps):
            step(i)
        end.record()
        torch.cuda.synchronize()
        windows.append(begin.elapsed_time(end) / args.steps)
    step_ms = min(windows)
    tokens_per_s = args.batch_size * args.context_length / (step_ms / 1e3)
    flops = training_flops_per_token(config, matmul_parameters(model))
    util = mfu(tokens_per_s, flops, device_peak(device))
    hardware = mfu(tokens_per_s, flops + recompute_flops_per_token(
        config, args.activation_checkpointing), device_peak(device))
    print(f"{args.preset}, batch {args.batch_size} x {args.context_length}, stack "
          f"{args.stack}, {device_label(device)}: step {step_ms:.1f} ms (windows "
          f"{', '.join(f'{w:.1f}' for w in windows)}), {tokens_per_s:,.0f} tokens/s, MFU "
          + ("n/a" if util is None else f"{100 * util:.1f}% (HFU {100 * hardware:.1f}%)")
          + f", activation checkpointing {args.activation_checkpointing}"
          + f", peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    if args.profile:
        print_profile(step)
    dist.destroy_process_group()


def print_profile(step) -> None:
    from torch.profiler import ProfilerActivity, profile

    steps = 2
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
    by_family: collections.Counter = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            by_family[family(event.name)] += getattr(event, "device_time", None) or 0.0
    total = sum(by_family.values())
    print(f"device time per step, by kernel family ({total / steps / 1e3:.1f} ms):")
    for name, us in by_family.most_common():
        print(f"  {name:30s} {us / steps / 1e3:8.2f} ms  {100 * us / total:5.1f}%")


if __name__ == "__main__":
    main()
