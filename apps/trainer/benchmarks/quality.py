"""How good a model the trainer makes in a given wall clock, with its defaults: the
validation loss beside gzip's and xz's figures on the same validation split (computed by
``lab2_trainer.data.corpus.compression_baselines``, not quoted), the training loss beside it,
the wall clock at which the validation loss first went below each compressor, and the wall
clock and tokens to a fixed target loss (``--target``, 0.85 nats/byte by default).

Each run is the real ``lab2-train`` in a fresh process (as a user runs it), with
evaluations spread over the run; what comes back is read from its ``metrics.jsonl`` and
``summary.json``. The training loss at an evaluation is the mean over the steps since the
previous one (the batches the model was trained on), so the two columns side by side show
when the model starts to fit its training split better than text it has not seen.

    python apps/trainer/benchmarks/quality.py --preset small --steps 3000 --out DIR
    python apps/trainer/benchmarks/quality.py --preset small --budget 600 --out DIR
    python apps/trainer/benchmarks/quality.py --preset medium --budget 600 -- --data python-env
    python apps/trainer/benchmarks/quality.py --device cpu                # the main command

``--budget SECONDS`` sizes ``--steps`` so that the run's wall clock fills the budget. Two
probes run first, fresh processes whose time is not counted: one step, which leaves warm
what the run then finds warm (the compiler's caches, the corpus's cache), then
:data:`PROBE_STEPS` steps logged every :data:`PROBE_LOG_EVERY`. A steady step's time is the
median ``step_seconds`` of that probe's steps after :data:`PROBE_WARM_STEPS` (the first
step compiles; the next ones still warm up and make the checkpoint's pinned buffers); what
the run spends apart from its steps and evaluations is the probe's wall clock less its
steps at that time and its evaluation (:func:`size_run`). Anything after ``--`` goes to
``lab2-train`` as it is.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

EVALS = 20  # evaluations spread over a run
#: The measuring probe of ``--budget``: its steps, its fetch windows (each window's mean is
#: its steps' ``step_seconds``), the steps before the steady ones, and its evaluation batches.
PROBE_STEPS = 40
PROBE_LOG_EVERY = 5
PROBE_WARM_STEPS = 15
PROBE_EVAL_BATCHES = 4
#: The target validation loss of ``--target`` (nats/byte): 30% below xz -9e on the default
#: corpus's validation split (1.1824 there).
TARGET = 0.85


def command(args: argparse.Namespace, out: Path, steps: int, *, probe: bool = False
            ) -> list[str]:
    """The ``lab2-train`` command of a run (or of a ``--budget`` probe): the trainer's
    defaults (precision and compilation left to the device), one process on a GPU."""
    cmd = [sys.executable, "-m", "lab2_trainer.cli", "--preset", args.preset,
           "--steps", str(steps), "--out", str(out), "--quiet", "--sample-tokens", "0"]
    if args.device == "cuda":
        cmd += ["--device", "cuda", "--nproc", "1"]
    else:
        cmd += ["--device", "cpu"]
    if probe:
        cmd += ["--log-every", str(PROBE_LOG_EVERY), "--eval-every", "0",
                "--eval-batches", str(PROBE_EVAL_BATCHES)]
    else:
        cmd += ["--log-every", "50", "--eval-every", str(eval_every(steps)),
                "--eval-batches", str(args.eval_batches)]
    return cmd + args.extra


def eval_every(steps: int) -> int:
    """A run's ``--eval-every``: about :data:`EVALS` evaluations spread over it."""
    return max(1, steps // EVALS)


def eval_count(steps: int) -> int:
    """The evaluations of a run of ``steps``: every ``eval_every`` steps, and at the end."""
    every = eval_every(steps)
    return steps // every + (steps % every != 0)


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl``."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def run(cmd: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run ``lab2-train``; its metrics records and summary."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"lab2-train failed ({done.returncode}):\n{done.stderr[-3000:]}")
    out = Path(cmd[cmd.index("--out") + 1])
    return (read_records(out / "metrics.jsonl"),
            json.loads((out / "summary.json").read_text(encoding="utf-8")))


def steady_step_seconds(records: list[dict[str, Any]], warm_steps: int = PROBE_WARM_STEPS
                        ) -> float:
    """A steady step's seconds: the median ``step_seconds`` of the steps after
    ``warm_steps`` (of every step after the first when there are none)."""
    steady = [r["step_seconds"] for r in records if r["step"] > warm_steps] or [
        r["step_seconds"] for r in records if r["step"] > 1]
    if not steady:
        raise ValueError("the probe logged no step after its first")
    return statistics.median(steady)


def size_run(records: list[dict[str, Any]], summary: dict[str, Any], budget: float,
             eval_batches: int) -> tuple[int, dict[str, Any]]:
    """The steps that fill ``budget`` seconds, from the measuring probe's records and
    summary; and the figures it used.

    A run's wall clock is its fixed part (start-up, compilation, the first steps' warm-up,
    the last checkpoint, the plot), its steps at a steady step's time, and its evaluations
    (:func:`eval_count` of ``eval_batches``). The probe's fixed part is its wall clock less
    its steps at that time and its evaluation (the probe ran warm, as the run will); an
    evaluation batch costs the probe's evaluation over its batches. The run gets the most
    steps whose wall clock stays within the budget (at least the probe's).
    """
    step_s = steady_step_seconds(records)
    clock = summary["wall_clock"]
    eval_batch_s = clock["evaluation_s"] / PROBE_EVAL_BATCHES
    fixed = max(0.0, clock["wall_s"] - summary["steps"] * step_s - clock["evaluation_s"])

    def evaluating(steps: int) -> float:
        return eval_count(steps) * eval_batches * eval_batch_s

    steps = max(PROBE_STEPS, int((budget - fixed) / step_s))
    while steps > PROBE_STEPS and fixed + steps * step_s + evaluating(steps) > budget:
        steps -= 1
    return steps, {"probe_step_s": step_s, "probe_fixed_s": fixed,
                   "probe_eval_batch_s": eval_batch_s, "planned_eval_s": evaluating(steps),
                   "planned_wall_s": fixed + steps * step_s + evaluating(steps)}


def budget_steps(args: argparse.Namespace, root: Path) -> tuple[int, dict[str, Any]]:
    """The steps that fill ``args.budget`` seconds of wall clock, from two probe runs: one
    step to warm the caches, then the measuring probe (:func:`size_run`)."""
    run(command(args, root / "warm", 1, probe=True))
    records, summary = run(command(args, root / "probe", PROBE_STEPS, probe=True))
    return size_run(records, summary, args.budget, args.eval_batches)


def evaluations(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per evaluation: step, wall clock, tokens trained on, mean training loss since
    the previous evaluation, validation loss."""
    rows, window = [], []
    for r in records:
        window.append(r["loss"])
        if "val_loss" in r:
            rows.append({"step": r["step"], "wall_s": r["wall_clock"]["wall_s"],
                         "tokens": r.get("tokens"), "train": sum(window) / len(window),
                         "val": r["val_loss"]})
            window = []
    return rows


def first_below(rows: list[dict[str, Any]], figure: float) -> dict[str, Any] | None:
    return next((r for r in rows if r["val"] < figure), None)


def time_to_target(rows: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """The first evaluation at or below ``target``: its wall clock, tokens and step (None
    each when the run never got there)."""
    hit = next((r for r in rows if r["val"] <= target), None)
    return {"target": target, "target_s": hit and hit["wall_s"],
            "target_tokens": hit and hit["tokens"], "target_step": hit and hit["step"]}


def target_text(result: dict[str, Any]) -> str:
    """``"reached 0.85 at 52 s (24,576,000 tokens)"`` or ``"not reached"``."""
    if result["target_s"] is None:
        return "not reached"
    tokens = result["target_tokens"]
    return (f"reached {result['target']:g} at {result['target_s']:.0f} s"
            + (f" ({tokens:,} tokens)" if tokens is not None else ""))


def report(rows: list[dict[str, Any]], summary: dict[str, Any],
           target: float = TARGET) -> dict[str, Any]:
    compression = summary["compression"]
    best = min(rows, key=lambda r: r["val"])
    out = {"final_val": rows[-1]["val"], "final_train": rows[-1]["train"],
           "best_val": best["val"], "best_step": best["step"], "best_wall_s": best["wall_s"],
           "wall_s": summary["wall_clock"]["wall_s"], "steps": summary["steps"],
           "tokens": summary["tokens"], **{k: v for k, v in compression.items()},
           **time_to_target(rows, target)}
    for name, figure in compression.items():
        hit = first_below(rows, figure)
        out[f"below_{name}_s"] = hit["wall_s"] if hit else None
        out[f"val_vs_{name}"] = rows[-1]["val"] / figure - 1
    out["best_vs_xz"] = best["val"] / compression["xz"] - 1
    return out


def markdown(result: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    def when(seconds: float | None) -> str:
        return "never" if seconds is None else f"{seconds:.0f} s"
    lines = [f"`{' '.join(result['command'])}`", "",
             "| step | wall clock (s) | train loss | val loss |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['step']} | {r['wall_s']:.0f} | {r['train']:.4f} | {r['val']:.4f} |"
              for r in rows]
    lines += ["", "| | nats/byte |", "|---|---:|",
              f"| gzip -9 (validation split) | {result['gzip']:.4f} |",
              f"| xz -9e (validation split) | {result['xz']:.4f} |",
              f"| final validation loss | {result['final_val']:.4f} "
              f"({result['val_vs_xz']:+.1%} against xz) |",
              f"| best validation loss | {result['best_val']:.4f} at step {result['best_step']}"
              f" ({result['best_vs_xz']:+.1%} against xz) |",
              f"| final training loss | {result['final_train']:.4f} |",
              f"| target {result['target']:g} | {target_text(result)} |", "",
              f"Wall clock {result['wall_s']:.0f} s for {result['steps']} steps; validation "
              f"below gzip at {when(result['below_gzip_s'])}, below xz at "
              f"{when(result['below_xz_s'])}."]
    clock = result.get("wall_clock")
    if clock:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in clock.get("startup_parts", {}).items()
                          if v >= 0.05)
        lines.append(f"Where it went (s): start-up {clock['startup_s']:.1f} ({parts}), "
                     f"compilation {clock['compilation_s']:.1f}, training "
                     f"{clock['training_s']:.1f}, evaluation {clock['evaluation_s']:.1f}, "
                     f"other {clock['other_s']:.1f}.")
    if result.get("budget_s"):
        lines.append(f"Budget {result['budget_s']:.0f} s: the run took {result['wall_s']:.0f} "
                     f"s ({result['wall_s'] / result['budget_s']:.0%}).")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    wall = [r["wall_s"] for r in rows]
    ax.plot(wall, [r["train"] for r in rows], "o-", ms=3, label="train (mean since last eval)")
    ax.plot(wall, [r["val"] for r in rows], "o-", ms=3, label="validation")
    ax.axhline(result["gzip"], color="black", ls=":", lw=1, label="gzip -9")
    ax.axhline(result["xz"], color="black", ls="-.", lw=1, label="xz -9e")
    ax.axhline(result["target"], color="grey", ls="--", lw=1, label=f"target {result['target']:g}")
    ax.set_xlabel("wall clock since launch (s)")
    ax.set_ylabel("nats / byte")
    ax.set_ylim(top=max(result["gzip"] * 1.6, min(r["val"] for r in rows) * 1.2))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda where there is one")
    p.add_argument("--steps", type=int, help="default: the preset's run default (200), or "
                   "what --budget fills")
    p.add_argument("--budget", type=float, metavar="SECONDS",
                   help="size --steps to this wall clock (two probe runs measure it first)")
    p.add_argument("--eval-batches", type=int, default=32)
    p.add_argument("--target", type=float, default=TARGET, metavar="LOSS",
                   help=f"report the wall clock and tokens to this validation loss, nats/byte "
                   f"(default {TARGET})")
    p.add_argument("--out", type=Path, help="write quality.jsonl, quality.md, quality.png here")
    args = p.parse_args(argv)
    args.extra = extra
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.steps is not None and args.budget is not None:
        p.error("give --steps or --budget, not both")
    if args.budget is not None and not (math.isfinite(args.budget) and args.budget > 0):
        p.error(f"--budget must be a positive number of seconds, got {args.budget}")
    if not (math.isfinite(args.target) and args.target > 0):
        p.error(f"--target must be a positive loss, got {args.target}")
    root = Path(tempfile.mkdtemp(prefix="lab2-quality-"))
    sizing: dict[str, Any] = {}
    steps = args.steps or 200
    if args.budget is not None:
        steps, sizing = budget_steps(args, root)
    cmd = command(args, root / "run", steps)
    records, summary = run(cmd)
    rows = evaluations(records)
    result = {"preset": args.preset, "device": args.device, "budget_s": args.budget,
              **sizing, **report(rows, summary, args.target), "command": cmd[1:],
              "budget_fill": None if args.budget is None else summary["wall_clock"]["wall_s"]
              / args.budget,
              "settings": summary["settings"], "setup": summary["setup"],
              "wall_clock": summary["wall_clock"]}
    text = markdown(result, rows)
    print(text, end="")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "quality.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps({**result, "evaluations": rows}) + "\n")
        (args.out / "quality.md").write_text(text, encoding="utf-8")
        try:
            plot(rows, result, args.out / "quality.png")
        except ImportError:  # matplotlib is the dev group's, not the trainer's
            print("quality.png not drawn: matplotlib is not installed", file=sys.stderr)
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
