"""Forward, forward+backward and training-step time of the model on one device, per preset,
alone or comparing autocast precisions, eager against ``torch.compile``, or norm layers.

    python apps/trainer/benchmarks/step_time.py --quick                    # seconds, CPU
    python apps/trainer/benchmarks/step_time.py --preset small,medium      # time per preset
    python apps/trainer/benchmarks/step_time.py --compare precision        # fp32, bf16 (fp16)
    python apps/trainer/benchmarks/step_time.py --compare compile --mode reduce-overhead
    python apps/trainer/benchmarks/step_time.py --compare norm --norms tritonnorm,torch

The variants are measured in interleaved rounds (``--rounds``): each round builds and times
every variant's model once (``--warmup`` untimed steps, then ``--steps`` timed, with
``lab2bench.measure``), in an order rotated by one each round, so a slow spell of a shared
machine falls on all of them; the figures pool the timed steps of every round, and
``speedup_vs_<first>`` compares each with the baseline (fp32, eager, the reference norm).
``mfu`` is model FLOPs utilisation against the device's dense bf16 peak (a forward counts a
third of a training step's FLOPs), empty where no peak is known.
"""

from __future__ import annotations

from typing import Any

import harness
import torch

from lab2_trainer.config import NORM_KINDS
from lab2_trainer.models.shapes import training_flops_per_token
from lab2_trainer.reporting.report import device_peak, matmul_parameters, mfu

#: Modes timed by default, and the baseline of each comparison.
MODES = {"none": "forward,forward_backward", "precision": ",".join(harness.MODES),
         "compile": ",".join(harness.MODES), "norm": "forward_backward,train_step"}
BASELINE = {"precision": "fp32", "compile": "eager", "norm": "reference"}
COLUMNS = ["preset", "params_M", "mode", "norm", "precision", "compiled", "mean_ms", "std_ms",
           "tokens_per_s", "mfu"]


def parse_args(argv: list[str] | None = None):
    p = harness.parser(__doc__.split("\n\n")[0])
    p.add_argument("--compare", choices=("none", *BASELINE), default="none")
    p.add_argument("--modes", type=harness.split, default=None,
                   help=f"comma-separated, from {', '.join(harness.MODES)}")
    p.add_argument("--precisions", type=harness.split, default=None,
                   help="--compare precision: default fp32,bf16, plus fp16 on CUDA")
    p.add_argument("--norms", type=harness.split, default=list(NORM_KINDS),
                   help=f"--compare norm: from {', '.join(NORM_KINDS)}")
    p.add_argument("--backend", default=None,
                   help="--compare compile: torch.compile backend (default inductor; "
                        "aot_eager with --quick)")
    p.add_argument("--mode", dest="compile_mode", default=None,
                   help="--compare compile: torch.compile mode (e.g. reduce-overhead)")
    args = harness.parse(p, argv)
    args.modes = harness.check_names(p, "mode", args.modes or MODES[args.compare].split(","),
                                     harness.MODES)
    args.precisions = harness.check_names(
        p, "precision", args.precisions or ["fp32", "bf16"] + (
            ["fp16"] if args.device.startswith("cuda") else []), harness.AUTOCAST_PRECISIONS)
    args.norms = harness.check_names(p, "norm", dict.fromkeys(args.norms), NORM_KINDS)
    args.backend = args.backend or ("aot_eager" if args.quick else "inductor")
    return args


def variants(args) -> list[dict[str, Any]]:
    """(norm, precision, compiled) of every variant compared."""
    one = {"norm": args.norm, "precision": args.precision, "compiled": "eager"}
    if args.compare == "precision":
        return [{**one, "precision": p} for p in args.precisions]
    if args.compare == "norm":
        return [{**one, "norm": n} for n in args.norms]
    if args.compare == "compile":
        return [one, {**one, "compiled": "compiled"}]
    return [one]


def time_variant(args, preset: str, v: dict[str, Any]) -> tuple[Any, int, dict, float]:
    """Build the model of ``preset`` as ``v`` says and time every mode; returns its config,
    parameter count, ``{mode: Stats}`` and training FLOPs per token."""
    from lab2bench import measure

    device = torch.device(args.device)
    config = harness.build_config(preset, context_length=args.context_length,
                                  vocab_size=args.vocab_size, norm=v["norm"])
    model = harness.build_model(config, device, seed=args.seed)
    flops = training_flops_per_token(config, matmul_parameters(model))
    params = sum(p.numel() for p in model.parameters())
    timed, warmup = model, args.warmup
    if v["compiled"] == "compiled":
        timed = torch.compile(model, backend=args.backend, mode=args.compile_mode)
        warmup = max(warmup, 2)  # the first calls of each mode compile
    batch = harness.random_batch(config, args.batch_size, device, seed=args.seed)
    optimizer = harness.make_optimizer(model) if "train_step" in args.modes else None
    stats = {}
    for mode in args.modes:
        step = harness.make_step(timed, batch, mode=mode, precision=v["precision"],
                                 device=device, optimizer=optimizer,
                                 backward_thread=args.backward_thread)
        stats[mode] = measure(step, warmup=warmup, repeats=args.steps, device=device)
    del model, timed, optimizer, batch
    harness.free_memory(device)
    if v["compiled"] == "compiled":
        torch._dynamo.reset()  # every round compiles a fresh model: no cache limit is reached
    return config, params, stats, flops


def main(argv: list[str] | None = None) -> int:
    from lab2bench import Stats

    args = parse_args(argv)
    out = harness.Output("step_time", args.out)
    tokens = args.batch_size * args.context_length
    todo = variants(args)
    for preset in args.presets:
        samples: list[dict[str, list[float]]] = [{m: [] for m in args.modes} for _ in todo]
        means: list[dict[str, list[float]]] = [{m: [] for m in args.modes} for _ in todo]
        built: dict[int, tuple] = {}
        for rnd in range(args.rounds):
            shift = rnd % len(todo)
            for i in [*range(shift, len(todo)), *range(shift)]:
                config, params, stats, flops = time_variant(args, preset, todo[i])
                built[i] = (config.norm, params, flops)
                for mode, st in stats.items():
                    samples[i][mode] += st.samples
                    means[i][mode].append(st.mean * 1e3)
        for i, v in enumerate(todo):
            norm, params, flops = built[i]
            for mode in args.modes:
                metrics = harness.stats_metrics(Stats.from_samples(samples[i][mode]), tokens)
                metrics["mfu"] = mfu(metrics["tokens_per_s"],
                                     flops / 3 if mode == "forward" else flops,
                                     device_peak(args.device))
                metrics["round_means_ms"] = means[i][mode]
                out.add({"preset": preset, "params_M": params / 1e6, **v, "norm": norm,
                         "mode": mode, "backend": args.backend if v["compiled"] != "eager"
                         else "-", "batch_size": args.batch_size,
                         "context_length": args.context_length, "device": args.device,
                         "warmup": args.warmup, "steps": args.steps, "rounds": args.rounds,
                         "backward_thread": args.backward_thread}, metrics)
    columns = COLUMNS
    if args.compare != "none":
        key = "compiled" if args.compare == "compile" else args.compare
        names = [v[key] for v in todo]
        baseline = BASELINE[args.compare] if BASELINE[args.compare] in names else names[0]
        harness.speedups(out.rows, key, baseline, ("preset", "mode"))
        columns = [*COLUMNS, f"speedup_vs_{baseline}"]
    out.table(columns, f"step time: batch {args.batch_size} x context {args.context_length}, "
                       f"{args.device}, {args.rounds} interleaved round(s) x {args.warmup} "
                       f"warm-up + {args.steps} timed steps, backward on the "
                       f"{args.backward_thread} thread")
    out.note(harness.mfu_note(args.device))
    if args.compare == "none":
        out.plot("time", x="params_M", y="mean_ms", series="mode")
    out.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
