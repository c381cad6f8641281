"""Suite ``compile``: eager against ``torch.compile`` of the same model."""

from __future__ import annotations

import argparse

import torch

from lab2_trainer.bench.e2e import measure_preset, mfu_note
from lab2_trainer.bench.precision import add_speedups
from lab2bench.suites import SuiteOutput

COLUMNS = ["preset", "mode", "compiled", "backend", "mean_ms", "std_ms", "speedup_vs_eager",
           "tokens_per_s", "mfu"]


def run(args: argparse.Namespace, out: SuiteOutput) -> None:
    backend = args.backend or ("aot_eager" if args.quick else "inductor")
    for preset in args.presets:
        measure_preset(args, out, preset, norm=args.norm, precision=args.precision,
                       modes=args.modes, extra={"compiled": "eager", "backend": "-"})
        # Warm-up steps include compilation (dynamo traces on the first call of each mode),
        # so give compiled runs at least two untimed calls.
        compile_args = argparse.Namespace(**{**vars(args), "warmup": max(args.warmup, 2)})

        def wrap(model: torch.nn.Module) -> torch.nn.Module:
            return torch.compile(model, backend=backend, mode=args.compile_mode)

        measure_preset(compile_args, out, preset, norm=args.norm, precision=args.precision,
                       modes=args.modes, wrap=wrap,
                       extra={"compiled": "compiled", "backend": backend})
    add_speedups(out, key="compiled", baseline="eager")
    out.table(COLUMNS, title=f"compile: batch {args.batch_size} x context {args.context_length}, "
                             f"{args.device}, {args.precision}")
    out.note(mfu_note(args.device))
