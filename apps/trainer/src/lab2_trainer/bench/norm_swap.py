"""Suite ``norm``: the norm layer swapped in the full model.

tritonnorm's fused RMSNorm, the reference (``RMSNormTorchFunction``, plain PyTorch with a
hand-derived backward), ``torch.nn.RMSNorm`` and ``nn.LayerNorm``: forward+backward and the
whole training step (AdamW). Off CUDA tritonnorm runs its plain-PyTorch path.
"""

from __future__ import annotations

import argparse

from lab2_trainer.bench.e2e import measure_preset
from lab2_trainer.bench.report import SuiteOutput
from lab2_trainer.bench.steps import MODES

NAME = "norm"
HELP = "norm swap in the full model: tritonnorm vs reference vs torch RMSNorm vs LayerNorm"
COLUMNS = ["preset", "mode", "norm", "precision", "mean_ms", "std_ms", "speedup_vs_reference",
           "tokens_per_s"]
NORMS = ["tritonnorm", "reference", "torch", "layernorm"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--norms", type=lambda s: s.split(","), default=NORMS,
                        help=f"comma-separated, from {', '.join(NORMS)}")
    parser.add_argument("--modes", type=lambda s: s.split(","),
                        default=["forward_backward", "train_step"],
                        help=f"comma-separated, from {', '.join(MODES)}")


def run(args: argparse.Namespace, out: SuiteOutput) -> None:
    bad = [n for n in args.norms if n not in NORMS]
    if bad:
        raise SystemExit(f"lab2-train bench norm: unknown norm(s) {', '.join(bad)}")
    for preset in args.presets:
        for norm in args.norms:
            measure_preset(args, out, preset, norm=norm, precision=args.precision,
                           modes=args.modes)
    base = {(r["preset"], r["mode"]): r["mean_ms"] for r in out.rows if r["norm"] == "reference"}
    for r in out.rows:
        ref = base.get((r["preset"], r["mode"]))
        r["speedup_vs_reference"] = ref / r["mean_ms"] if ref and r["mean_ms"] > 0 else None
    out.table(COLUMNS, title=f"norm swap: batch {args.batch_size} x context "
                             f"{args.context_length}, {args.device}")
