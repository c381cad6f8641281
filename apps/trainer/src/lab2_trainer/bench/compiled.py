"""Suite ``compile``: eager against ``torch.compile`` of the same model."""

from __future__ import annotations

import argparse

import torch

from lab2_trainer.bench.e2e import measure_preset, mfu_note
from lab2_trainer.bench.precision import add_speedups
from lab2_trainer.bench.steps import MODES
from lab2bench.suites import SuiteOutput

NAME = "compile"
HELP = "eager vs torch.compile: forward, forward+backward and training step"
COLUMNS = ["preset", "mode", "compiled", "backend", "mean_ms", "std_ms", "speedup_vs_eager",
           "tokens_per_s", "mfu"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default=None,
                        help="torch.compile backend (default inductor; aot_eager with --quick, "
                             "which needs no C++ compiler and compiles in seconds)")
    parser.add_argument("--mode", dest="compile_mode", default=None,
                        help="torch.compile mode (e.g. max-autotune)")
    parser.add_argument("--modes", type=lambda s: s.split(","),
                        default=["forward", "forward_backward", "train_step"],
                        help=f"comma-separated, from {', '.join(MODES)}")


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
