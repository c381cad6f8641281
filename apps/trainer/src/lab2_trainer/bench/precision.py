"""Suite ``precision``: fp32 against bf16 (and fp16) autocast on the same model."""

from __future__ import annotations

import argparse

from lab2_trainer.bench.arguments import MODES
from lab2_trainer.bench.e2e import measure_preset
from lab2_trainer.bench.workload import PRECISIONS
from lab2bench.suites import SuiteOutput

COLUMNS = ["preset", "mode", "precision", "mean_ms", "std_ms", "speedup_vs_fp32",
           "tokens_per_s"]


def run(args: argparse.Namespace, out: SuiteOutput) -> None:
    precisions = args.precisions or (["fp32", "bf16", "fp16"] if args.device.startswith("cuda")
                                     else ["fp32", "bf16"])
    bad = [p for p in precisions if p not in PRECISIONS] + [m for m in args.modes
                                                            if m not in MODES]
    if bad:
        raise SystemExit(f"lab2-train bench precision: unknown value(s) {', '.join(bad)}")
    for preset in args.presets:
        for prec in precisions:
            measure_preset(args, out, preset, norm=args.norm, precision=prec, modes=args.modes)
    add_speedups(out, key="precision", baseline="fp32")
    out.table(COLUMNS, title=f"precision: batch {args.batch_size} x context "
                             f"{args.context_length}, {args.device}")


def add_speedups(out: SuiteOutput, *, key: str, baseline: str) -> None:
    """``speedup_vs_<baseline>``: the baseline row's mean over each row's, per preset and mode."""
    base = {(r["preset"], r["mode"]): r["mean_ms"] for r in out.rows if r[key] == baseline}
    for r in out.rows:
        ref = base.get((r["preset"], r["mode"]))
        r[f"speedup_vs_{baseline}"] = ref / r["mean_ms"] if ref and r["mean_ms"] > 0 else None
