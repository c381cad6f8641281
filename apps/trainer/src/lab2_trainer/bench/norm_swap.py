"""Suite ``norm``: the norm layer swapped in the full model.

tritonnorm's fused RMSNorm, the reference (``RMSNormTorchFunction``, plain PyTorch with a
hand-derived backward), ``torch.nn.RMSNorm`` and ``nn.LayerNorm``: forward+backward and the
whole training step (AdamW). Off CUDA tritonnorm runs its plain-PyTorch path.

The norms are measured in interleaved rounds (``--rounds``): each round builds and times
every norm's model once, in an order rotated by one each round, so a slow spell of a shared
machine falls on all of them; the figures pool the timed steps of every round.

``--profile`` then runs a few steps of each norm's model under ``torch.profiler`` and
prints the norm ops' CPU µs per call and the top ops by CPU time (``norm_profile``).
"""

from __future__ import annotations

import argparse
from typing import Any

from lab2_trainer.bench.arguments import MODES, NORMS
from lab2_trainer.bench.distributed import thread_label
from lab2_trainer.bench.e2e import row_config, time_preset
from lab2_trainer.bench.steps import stats_metrics
from lab2bench.suites import SuiteOutput

COLUMNS = ["preset", "mode", "norm", "precision", "mean_ms", "std_ms", "speedup_vs_reference",
           "tokens_per_s"]
def run(args: argparse.Namespace, out: SuiteOutput) -> None:
    from lab2bench import Stats

    bad = [n for n in args.norms if n not in NORMS]
    if bad:
        raise SystemExit(f"lab2-train bench norm: unknown norm(s) {', '.join(bad)}")
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        raise SystemExit(f"lab2-train bench norm: unknown mode(s) {', '.join(bad)}")
    if args.rounds < 1:
        raise SystemExit("lab2-train bench norm: --rounds must be >= 1")
    if args.profile_steps is not None and args.profile_steps < 1:
        raise SystemExit("lab2-train bench norm: --profile-steps must be >= 1")
    norms = list(dict.fromkeys(args.norms))
    tokens = args.batch_size * args.context_length
    for preset in args.presets:
        samples: dict[str, dict[str, list[float]]] = {n: {m: [] for m in args.modes}
                                                      for n in norms}
        round_means: dict[str, dict[str, list[float]]] = {n: {m: [] for m in args.modes}
                                                          for n in norms}
        built: dict[str, tuple[str, int]] = {}
        for rnd in range(args.rounds):
            shift = rnd % len(norms)
            for norm in norms[shift:] + norms[:shift]:
                config, params, stats, _ = time_preset(args, preset, norm=norm,
                                                    precision=args.precision, modes=args.modes)
                built[norm] = (config.norm, params)
                for mode, st in stats.items():
                    samples[norm][mode].extend(st.samples)
                    round_means[norm][mode].append(st.mean * 1e3)
        for norm in norms:
            norm_name, params = built[norm]
            for mode in args.modes:
                metrics: dict[str, Any] = stats_metrics(
                    Stats.from_samples(samples[norm][mode]), tokens)
                metrics["round_means_ms"] = round_means[norm][mode]
                out.add(row_config(args, preset, params, norm_name, args.precision, mode,
                                   {"rounds": args.rounds}), metrics)
    base = {(r["preset"], r["mode"]): r["mean_ms"] for r in out.rows if r["norm"] == "reference"}
    for r in out.rows:
        ref = base.get((r["preset"], r["mode"]))
        r["speedup_vs_reference"] = ref / r["mean_ms"] if ref and r["mean_ms"] > 0 else None
    out.table(COLUMNS, title=f"norm swap: batch {args.batch_size} x context "
                             f"{args.context_length}, {args.device}, {args.rounds} interleaved "
                             f"round(s) x {args.steps} timed steps, {thread_label(args)}")
    if args.profile:
        from lab2_trainer.bench.norm_profile import run_profiles

        run_profiles(args, norms).finish()
