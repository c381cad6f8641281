"""Peak memory of forward, forward+backward and a full AdamW step, per preset and context
length, with the parameter, gradient and optimizer-state bytes counted from the tensors.

    python apps/trainer/benchmarks/memory.py --quick
    python apps/trainer/benchmarks/memory.py --device cuda --preset medium \\
        --context-lengths 256,512,1024 --out OUT

Peaks come from ``lab2bench.peak_memory``: the CUDA allocator on GPU, the sampled resident
set on the CPU (there ``increase_MiB``, the peak above the level when the region began, is
the figure to read). On CUDA with ``--out`` the full step is also recorded with
``lab2bench.memory_snapshot`` (a pickle for pytorch.org/memory_viz and an HTML timeline).
"""

from __future__ import annotations

import contextlib

import harness
import torch

MIB = harness.MIB
COLUMNS = ["preset", "context_length", "precision", "region", "peak_MiB", "increase_MiB",
           "param_MiB", "grad_MiB", "optim_state_MiB"]


def measure_one(args, out: harness.Output, preset: str, ctx: int) -> None:
    from lab2bench import memory_snapshot, peak_memory

    device = torch.device(args.device)
    config = harness.build_config(preset, context_length=ctx, vocab_size=args.vocab_size,
                                  norm=args.norm)
    model = harness.build_model(config, device, seed=args.seed)
    optimizer = harness.make_optimizer(model)
    batch = harness.random_batch(config, args.batch_size, device, seed=args.seed)
    regions = {mode: harness.make_step(model, batch, mode=mode, precision=args.precision,
                                       device=device, optimizer=optimizer)
               for mode in harness.MODES}
    regions["train_step"]()  # AdamW's state exists from the first step: measure the steady one
    conf = {"preset": preset, "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
            "norm": config.norm, "context_length": ctx, "batch_size": args.batch_size,
            "precision": args.precision, "device": args.device}
    for region, fn in regions.items():
        model.zero_grad(set_to_none=True)
        harness.free_memory(device)
        snap = contextlib.nullcontext()
        if region == "train_step" and device.type == "cuda" and args.out and not args.no_snapshot:
            snap = memory_snapshot(f"{args.out}/memory-{preset}-ctx{ctx}", device=device)
        with snap, peak_memory(device) as mem:
            fn()
        parts = harness.held_bytes(model, optimizer)
        out.add({**conf, "region": region},
                {"peak_MiB": mem.peak_bytes / MIB, "increase_MiB": mem.increase_bytes / MIB,
                 "start_MiB": mem.start_bytes / MIB, "source": mem.source,
                 "param_MiB": parts["param_bytes"] / MIB, "grad_MiB": parts["grad_bytes"] / MIB,
                 "optim_state_MiB": parts["optim_state_bytes"] / MIB})
    del model, optimizer, batch, regions
    harness.free_memory(device)


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__.split("\n\n")[0], rounds=False)
    p.add_argument("--context-lengths", type=lambda s: [int(x) for x in s.split(",")],
                   default=None, help="comma-separated (default: --context-length)")
    p.add_argument("--no-snapshot", action="store_true",
                   help="skip the CUDA memory snapshot of the full step")
    args = harness.parse(p, argv)
    out = harness.Output("memory", args.out)
    for preset in args.presets:
        for ctx in args.context_lengths or [args.context_length]:
            measure_one(args, out, preset, ctx)
    out.table(COLUMNS, f"memory: batch {args.batch_size}, {args.device}")
    out.plot("peak", x="context_length", y="peak_MiB", series="region")
    out.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
