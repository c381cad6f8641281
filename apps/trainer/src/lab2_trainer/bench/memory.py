"""Suite ``memory``: peak memory of forward, forward+backward and a full AdamW step, per preset
and context length, with the static breakdown (parameters, gradients, optimizer state).

Peaks come from ``lab2bench.peak_memory``: the CUDA allocator on GPU, the sampled resident
set on the CPU (there, ``increase_MiB``, the peak above the level when the region began, is
the figure to read; absolute values include the interpreter). On CUDA with ``--out`` the
full step is also recorded with ``lab2bench.memory_snapshot`` (a pickle for
pytorch.org/memory_viz and an HTML timeline).
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from lab2_trainer.bench.steps import make_optimizer, make_step
from lab2_trainer.bench.workload import (
    build_config,
    build_model,
    count_parameters,
    free_memory,
    random_batch,
    tensor_breakdown,
)
from lab2bench.suites import SuiteOutput

COLUMNS = ["preset", "context_length", "precision", "region", "peak_MiB", "increase_MiB",
           "param_MiB", "grad_MiB", "optim_state_MiB"]
MIB = 2**20


def run(args: argparse.Namespace, out: SuiteOutput) -> None:
    lengths = args.context_lengths or [args.context_length]
    for preset in args.presets:
        for ctx in lengths:
            measure_one(args, out, preset, ctx)
    out.table(COLUMNS, title=f"memory: batch {args.batch_size}, {args.device}")
    out.plot("peak", x="context_length", y="peak_MiB", series="region")


def measure_one(args: argparse.Namespace, out: SuiteOutput, preset: str, ctx: int) -> None:
    from lab2bench import memory_snapshot, peak_memory

    device = torch.device(args.device)
    config = build_config(preset, context_length=ctx, vocab_size=args.vocab_size, norm=args.norm,
                          overrides=args.overrides)
    model = build_model(config, device, seed=args.seed)
    optimizer = make_optimizer(model)
    batch = random_batch(config, args.batch_size, device, seed=args.seed)
    step = make_step(model, batch, mode="train_step", precision=args.precision, device=device,
                     optimizer=optimizer)
    step()  # the first step creates AdamW's state; the regions below see the steady state
    regions = {
        "forward": make_step(model, batch, mode="forward", precision=args.precision,
                             device=device),
        "forward_backward": make_step(model, batch, mode="forward_backward",
                                      precision=args.precision, device=device),
        "train_step": step,
    }
    conf = {"preset": preset, "params_M": count_parameters(model) / 1e6, "norm": config.norm,
            "context_length": ctx, "batch_size": args.batch_size, "precision": args.precision,
            "device": args.device}
    for region, fn in regions.items():
        model.zero_grad(set_to_none=True)
        free_memory(device)
        snap = contextlib.nullcontext()
        if region == "train_step" and device.type == "cuda" and args.out and not args.no_snapshot:
            snap = memory_snapshot(f"{args.out}/memory-{preset}-ctx{ctx}", device=device)
        with snap, peak_memory(device) as mem:
            result = fn()
            del result
        parts = tensor_breakdown(model, optimizer)
        out.add({**conf, "region": region},
                {"peak_MiB": mem.peak_bytes / MIB, "increase_MiB": mem.increase_bytes / MIB,
                 "start_MiB": mem.start_bytes / MIB, "source": mem.source,
                 "param_MiB": parts["param_bytes"] / MIB, "grad_MiB": parts["grad_bytes"] / MIB,
                 "optim_state_MiB": parts["optim_state_bytes"] / MIB})
    del model, optimizer, batch, step, regions
    free_memory(device)
