"""Tokens/s of ``--precision fp8`` (tensorwise and rowwise) against bf16, on one GPU, in
interleaved windows with an A/A control.

Every variant is the trainer's set-up of one model (``harness.setup``: ``parallelize`` with
its ``float8`` recipe, compiled as the trainer compiles, no sharding) and its step
(``train_step``: bf16 autocast, forward, backward, clipping, fused AdamW). The variants
share the model's weights and one AdamW (each a module tree of its own around the same
``Parameter`` objects, which a float8 conversion keeps), so their memory is one model's
training state and one step's activations: xl 32 x 512 fits on one H200. Each round times
a window of ``--window`` back-to-back steps of every variant, in a balanced order
(``lab2bench.timing.paired_windows``: A B C D, D C B A, B C D A, ...), and divides the
bf16 window's time by each variant's within the round; the median over the rounds is the
tokens/s ratio. ``bf16#2`` is the same bf16 step timed again under its own name: its ratio,
1 up to the noise, says how far apart two identical variants land on this machine::

    python3 apps/trainer/benchmarks/fp8_throughput.py --preset xl --batch-size 32
    python3 apps/trainer/benchmarks/fp8_throughput.py --preset medium --batch-size 16 \\
        --activation-checkpointing selective --variants bf16 tensorwise bf16#2
    python3 apps/trainer/benchmarks/fp8_throughput.py --device cpu   # plumbing, emulated

Without uv, with the sources on the path::

    PYTHONPATH=$(echo packages/*/src | tr ' ' :):apps/trainer/src \\
        python3 apps/trainer/benchmarks/fp8_throughput.py --preset xl --batch-size 32

The planner's predictions for the same runs are printed beside the measurements
(``lab2-train plan --precision fp8``: the blocks' products at ``--fp8-efficiency`` of the
float8 peak, fitted to one tensorwise run; it models no recipe, so both get one figure).
``--device cpu`` runs the micro model with torchao's float8 emulation: the plumbing only,
no meaningful times.
"""

from __future__ import annotations

import argparse
import functools

import harness
import torch
import torch.distributed as dist

from lab2_trainer.config import ACTIVATION_CHECKPOINTING, FP8_RECIPES, PRESETS
from lab2_trainer.planner.plan import Hardware, PlanInput, plan
from lab2_trainer.reporting.report import device_label, device_peak

#: The variants a run may name: bf16, and each float8 recipe (``NAME#2``: an A/A control).
KINDS = ("bf16", *FP8_RECIPES)
DEFAULT_VARIANTS = ["bf16", "tensorwise", "rowwise", "bf16#2"]
COLUMNS = ["variant", "median_ms", "min_ms", "tokens_per_s", "ratio", "ratio_q1", "ratio_q3",
           "predicted_ratio"]


def build_variants(base: torch.nn.Module, names: list[str], device: torch.device,
                   compile_spec: dict | None) -> dict[str, tuple]:
    """Each distinct variant set up once (``harness.setup``: ``parallelize`` with the
    recipe), all stepping one AdamW: ``{kind: (Parallel, precision)}``."""
    built: dict[str, tuple] = {}
    optimizer = None
    for name in names:
        kind = harness.kind_of(name)
        if kind in built:
            continue
        model = base if kind == "bf16" else harness.shared_copy(base)
        recipe = None if kind == "bf16" else kind
        variant = harness.setup(model, "none", device, compile=compile_spec, float8=recipe)
        # One AdamW state for every variant (created at its first step): the first's.
        optimizer = optimizer or variant.optimizer
        variant.optimizer = optimizer
        built[kind] = (variant, "bf16" if recipe is None else "fp8")
    return built


def predicted_ratios(config, batch: int, checkpointing: str, compiled: bool,
                     device: torch.device) -> dict[str, float]:
    """The planner's tokens/s of fp8 over bf16's for this run (the same for both recipes:
    it models no scaling granularity)."""
    peak = device_peak(device)
    hardware = Hardware(peak_tflops=peak.flops / 1e12) if peak else Hardware()
    speed = {}
    for precision in ("bf16", "fp8"):
        result = plan(PlanInput(config, batch_size=batch, precision=precision,
                                activation_checkpointing=checkpointing, compile=compiled,
                                hardware=hardware))
        speed[precision] = result["time"]["tokens_per_s"]
    return {kind: speed["bf16" if kind == "bf16" else "fp8"] / speed["bf16"] for kind in KINDS}


def main(argv: list[str] | None = None) -> int:
    from lab2bench.timing import paired_windows

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="xl", choices=list(PRESETS))
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    p.add_argument("--context-length", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=10000)
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS,
                   help=f"of {', '.join(KINDS)} (NAME#2: an A/A control); the first is the "
                        "baseline the ratios divide by (default: %(default)s)")
    p.add_argument("--activation-checkpointing", default="none",
                   choices=ACTIVATION_CHECKPOINTING)
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="eager steps (default: compiled block by block, as the trainer does)")
    p.add_argument("--compile-mode", default=None, help="torch.compile's mode")
    p.add_argument("--rounds", type=int, default=12, help="timed windows per variant")
    p.add_argument("--window", type=int, default=4, help="timed steps per window")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each variant first "
                   "(compilation, AdamW's state)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: the micro model, float8 emulated (plumbing only)")
    p.add_argument("--out", default=None, help="folder for fp8_throughput.jsonl and .md")
    args = p.parse_args(argv)
    harness.check_names(p, "variant", args.variants, KINDS)
    harness.check_paired_options(p, args, "the plumbing, float8 emulated")
    on_gpu = args.device == "cuda"
    if on_gpu:
        from lab2_trainer.models.float8 import device_problem

        problem = device_problem("cuda")
        if problem is not None:
            p.error(problem)
    device = harness.single_rank_group(on_gpu)
    preset = args.preset if on_gpu else "micro"
    context = args.context_length if on_gpu else 16
    batch = args.batch_size if on_gpu else 2
    config = harness.build_config(preset, context_length=context,
                                  vocab_size=args.vocab_size if on_gpu else 64)
    base = harness.build_model(config, device, seed=0)
    base.activation_checkpointing = args.activation_checkpointing
    compile_spec = ({"backend": "inductor", "mode": args.compile_mode, "scope": "blocks"}
                    if args.compile else None)
    try:
        built = build_variants(base, args.variants, device, compile_spec)
        batches = [harness.random_batch(config, batch, device, seed=i) for i in range(2)]
        count = [0]

        def step(kind: str) -> None:
            variant, precision = built[kind]
            count[0] += 1
            harness.step_marks(variant, batches[count[0] % 2], precision, device)

        steps = {name: functools.partial(step, harness.kind_of(name)) for name in args.variants}
        result = paired_windows(steps, rounds=args.rounds, window=args.window, device=device,
                                warmup=args.warmup)
        peak_gib = torch.cuda.max_memory_allocated(device) / 2**30 if on_gpu else None
    finally:
        dist.destroy_process_group()
    predicted = predicted_ratios(config, batch, args.activation_checkpointing, args.compile,
                                 device)
    tokens = batch * config.context_length
    base_name = args.variants[0]
    out = harness.Output("fp8_throughput", args.out)
    where = device_label(device)
    labels = {"preset": preset, "batch_size": batch, "context_length": config.context_length,
              "vocab_size": config.vocab_size, "device": where, "compile": args.compile,
              "activation_checkpointing": args.activation_checkpointing,
              "rounds": args.rounds, "window": args.window, "warmup": args.warmup,
              "baseline": base_name}
    for name, r in result.items():
        kind = harness.kind_of(name)
        out.add({**labels, "variant": name},
                {"median_ms": r["median_ms"], "min_ms": r["min_ms"], "times_ms": r["times_ms"],
                 "tokens_per_s": tokens / (r["median_ms"] / 1e3), "ratio": r["ratio"],
                 "ratio_q1": r["ratio_q1"], "ratio_q3": r["ratio_q3"],
                 "predicted_ratio": predicted[kind] / predicted[harness.kind_of(base_name)],
                 "peak_GiB_all_variants": peak_gib})
    compiled = "compiled" if args.compile else "eager"
    out.table(COLUMNS, f"{preset} {batch} x {config.context_length}, vocabulary "
                       f"{config.vocab_size}, one {where}, {compiled}, checkpointing "
                       f"{args.activation_checkpointing}; {args.rounds} rounds x {args.window} "
                       f"steps, ratio = {base_name}'s time / the variant's (> 1: more tokens/s)")
    controls = [n for n in args.variants if n != base_name
                and harness.kind_of(n) == harness.kind_of(base_name)]
    for name in controls:
        r = result[name]
        out.note(f"A/A control {name}: {r['ratio']:.3f} [{r['ratio_q1']:.3f}, "
                 f"{r['ratio_q3']:.3f}]: two identical steps land this far apart here, so a "
                 "ratio within that band of 1 is noise")
    if not on_gpu:
        out.note("cpu: float8 emulated in float32 (torchao's emulate): plumbing, not speed")
    out.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
