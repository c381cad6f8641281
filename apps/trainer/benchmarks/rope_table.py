"""Tokens/s of the rotary table (``CausalSelfAttention.rope_cos_sin``, the default) against
angles made inside each block's forward (the model before the table), on one GPU, in
interleaved windows with an A/A control.

Both variants are one model set up as the trainer sets it up (``harness.setup``: compiled
block by block, fused AdamW) around the same ``Parameter`` objects; ``computed`` is a copy
whose attention layers have no table, so :func:`lab2_trainer.models.transformer.rotate`
makes the angles itself, as it did before. Each round times a window of ``--window``
back-to-back trainer steps (bf16 autocast, forward, backward, clipping, AdamW) of every
variant in a balanced order (``lab2bench.timing.paired_windows``); the median ratio of the
``table`` window's time to each variant's is the tokens/s ratio, and ``table#2`` (the same
step again) says how far apart two identical variants land::

    python3 apps/trainer/benchmarks/rope_table.py --preset small --batch-size 32
    python3 apps/trainer/benchmarks/rope_table.py --device cpu   # plumbing: micro, eager

The record: apps/trainer/docs/benchmarks/2026-12-06-h100-rope-table.md.
"""

from __future__ import annotations

import argparse
import functools

import harness
import torch
import torch.distributed as dist

from lab2_trainer.config import PRESETS
from lab2_trainer.models.transformer import CausalSelfAttention
from lab2_trainer.reporting.report import device_label

KINDS = ("table", "computed")
COLUMNS = ["variant", "median_ms", "min_ms", "tokens_per_s", "ratio", "ratio_q1", "ratio_q3"]


def without_table(base: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``base`` around its very parameters whose attention layers make their
    rotary angles in their forward (no table)."""
    model = harness.shared_copy(base)
    for module in model.modules():
        if isinstance(module, CausalSelfAttention):
            module.rope_cos_sin = None
    return model


def main(argv: list[str] | None = None) -> int:
    from lab2bench.timing import paired_windows

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", choices=list(PRESETS))
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    p.add_argument("--context-length", type=int, default=512)
    p.add_argument("--rounds", type=int, default=8, help="timed windows per variant")
    p.add_argument("--window", type=int, default=10, help="timed steps per window")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each variant first")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: the micro model, eager (plumbing only)")
    p.add_argument("--out", default=None, help="folder for rope_table.jsonl and .md")
    args = p.parse_args(argv)
    harness.check_paired_options(p, args, "the plumbing")
    on_gpu = args.device == "cuda"
    device = harness.single_rank_group(on_gpu)
    preset = args.preset if on_gpu else "micro"
    context = args.context_length if on_gpu else 16
    batch = args.batch_size if on_gpu else 2
    config = harness.build_config(preset, context_length=context, vocab_size=256)
    if not config.rope:
        p.error(f"preset {preset} has no rotary positions")
    base = harness.build_model(config, device, seed=0)
    compile_spec = {"backend": "inductor", "mode": None, "scope": "blocks"} if on_gpu else None
    precision = "bf16" if on_gpu else "fp32"
    try:
        table = harness.setup(base, "none", device, compile=compile_spec)
        computed = harness.setup(without_table(base), "none", device, compile=compile_spec)
        computed.optimizer = table.optimizer  # one AdamW state for both
        built = {"table": table, "computed": computed}
        batches = [harness.random_batch(config, batch, device, seed=i) for i in range(2)]
        count = [0]

        def step(kind: str) -> None:
            count[0] += 1
            harness.step_marks(built[kind], batches[count[0] % 2], precision, device)

        names = [*KINDS, "table#2"]
        steps = {name: functools.partial(step, harness.kind_of(name)) for name in names}
        result = paired_windows(steps, rounds=args.rounds, window=args.window, device=device,
                                warmup=args.warmup)
    finally:
        dist.destroy_process_group()
    tokens = batch * config.context_length
    out = harness.Output("rope_table", args.out)
    where = device_label(device)
    for name, r in result.items():
        out.add({"preset": preset, "batch_size": batch, "context_length": context,
                 "device": where, "variant": name},
                {"median_ms": r["median_ms"], "min_ms": r["min_ms"], "times_ms": r["times_ms"],
                 "tokens_per_s": tokens / (r["median_ms"] / 1e3), "ratio": r["ratio"],
                 "ratio_q1": r["ratio_q1"], "ratio_q3": r["ratio_q3"]})
    out.table(COLUMNS, f"{preset} {batch} x {context}, one {where}, "
                       f"{'compiled' if on_gpu else 'eager'}, {precision}; {args.rounds} "
                       f"rounds x {args.window} steps, ratio = table's time / the variant's")
    r = result["table#2"]
    out.note(f"A/A control table#2: {r['ratio']:.3f} [{r['ratio_q1']:.3f}, {r['ratio_q3']:.3f}]")
    out.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
