"""Suite ``e2e``: forward and forward+backward time per preset (the handout's table).

One model per preset on one device, random token batches; warm-up steps are left out and
the figures are the mean and standard deviation over the timed steps. ``mfu`` is model FLOPs
utilisation against the device's dense bf16 peak (``lab2_trainer.report``; a forward counts a
third of a training step's FLOPs), empty on the CPU and on GPUs without a known peak.
"""

from __future__ import annotations

import argparse
from typing import Any

from lab2_trainer.bench.arguments import MODES
from lab2_trainer.bench.steps import stats_metrics, time_modes
from lab2_trainer.bench.workload import (
    build_config,
    build_model,
    count_parameters,
    free_memory,
    random_batch,
)
from lab2_trainer.config import ModelConfig
from lab2_trainer.report import (
    device_label,
    device_peak,
    matmul_parameters,
    mfu,
    training_flops_per_token,
)
from lab2bench.suites import SuiteOutput

COLUMNS = ["preset", "params_M", "precision", "mode", "mean_ms", "std_ms", "tokens_per_s", "mfu"]


def run(args: argparse.Namespace, out: SuiteOutput) -> None:
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        raise SystemExit(f"lab2-train bench e2e: unknown mode(s) {', '.join(bad)}")
    for preset in args.presets:
        measure_preset(args, out, preset, norm=args.norm, precision=args.precision,
                       modes=args.modes)
    out.table(COLUMNS, title=f"e2e: batch {args.batch_size} x context {args.context_length}, "
                             f"{args.device}, {args.warmup} warm-up + {args.steps} timed steps")
    out.note(mfu_note(args.device))
    out.plot("time", x="params_M", y="mean_ms", series="mode")


def measure_preset(args: argparse.Namespace, out: SuiteOutput, preset: str, *, norm: str | None,
                   precision: str, modes: list[str], extra: dict | None = None,
                   wrap=None) -> None:
    """Time ``modes`` of one preset and add a row per mode (shared by several suites).

    Args:
        wrap: optional function applied to the built model (e.g. ``torch.compile``).
        extra: more configuration fields for the rows (e.g. the compile backend).
    """
    config, params, stats, train_flops = time_preset(args, preset, norm=norm,
                                                     precision=precision, modes=modes, wrap=wrap)
    tokens = args.batch_size * args.context_length
    peak = device_peak(args.device)
    for mode, st in stats.items():
        metrics = stats_metrics(st, tokens)
        flops = train_flops / 3 if mode == "forward" else train_flops
        metrics["mfu"] = mfu(metrics["tokens_per_s"], flops, peak)
        out.add(row_config(args, preset, params, config.norm, precision, mode, extra), metrics)


def time_preset(args: argparse.Namespace, preset: str, *, norm: str | None, precision: str,
                modes: list[str], wrap=None) -> tuple[ModelConfig, int, dict[str, Any], float]:
    """Build the preset's model, time ``modes`` and free it.

    Returns the model's configuration, its parameter count, ``{mode: Stats}`` and the
    training FLOPs per token (for MFU).
    """
    config = build_config(preset, context_length=args.context_length,
                          vocab_size=args.vocab_size, norm=norm, overrides=args.overrides)
    model = build_model(config, args.device, seed=args.seed)
    params = count_parameters(model)
    train_flops = training_flops_per_token(config, matmul_parameters(model))
    timed = wrap(model) if wrap is not None else model
    batch = random_batch(config, args.batch_size, args.device, seed=args.seed)
    stats = time_modes(timed, batch, modes=modes, precision=precision,
                       device=model.tok_emb.weight.device, warmup=args.warmup, steps=args.steps,
                       backward_thread=args.backward_thread)
    del model, timed, batch
    free_memory(args.device)
    return config, params, stats, train_flops


def row_config(args: argparse.Namespace, preset: str, params: int, norm: str, precision: str,
               mode: str, extra: dict | None = None) -> dict[str, Any]:
    """The configuration fields of one timed row."""
    return {"preset": preset, "params_M": params / 1e6, "norm": norm,
            "precision": precision, "mode": mode, "batch_size": args.batch_size,
            "context_length": args.context_length, "device": args.device,
            "warmup": args.warmup, "steps": args.steps,
            "backward_thread": args.backward_thread, **(extra or {})}


def mfu_note(device: str) -> str:
    """The line under a table that says what ``mfu`` is measured against."""
    peak = device_peak(device)
    if peak is None:
        return (f"mfu: not reported (no known dense bf16 peak for {device_label(device)}).")
    return (f"mfu: model FLOPs (6N + 12·layers·d_model·context per token; a forward a third) "
            f"over {peak.name}, {peak.flops / 1e12:,.0f} TFLOP/s per device.")
