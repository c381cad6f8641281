"""``lab2-train plan``: print the prediction of :mod:`lab2_trainer.planner.plan` as tables, JSON
or a scaling plot.

Its flags that say what to run are ``lab2-train``'s, built from the same settings fields
(``--preset``, the model's fields, ``--batch-size``, ``--grad-accum``, ``--precision``,
``--sharding``, ``--ddp``, ``--activation-checkpointing``, ``--compile``,
``--reshard-after-forward``, ``--bucket-mb``) with the same defaults, so a run's flags plan
that run; ``--gpus-per-node`` x ``--nodes`` is the world, and the machine's figures are
:class:`lab2_trainer.planner.plan.Hardware`'s fields. Bad input costs one line on stderr and exit
code 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Any

from lab2_trainer.cli.flags import add_setting_flag, setting_fields
from lab2_trainer.config import (
    ACTIVATION_CHECKPOINTING,
    AUTO,
    AUTO_SETTINGS,
    EXIT_BAD_INPUT,
    PRESETS,
    ModelConfig,
    TrainSettings,
    UsageError,
    device_defaults,
    model_config,
)
from lab2_trainer.planner.layout import recommend
from lab2_trainer.planner.plan import GIB, Hardware, PlanInput, plan
from lab2_trainer.recipe.layout import SHARDING_KINDS
from lab2_trainer.runtime.paths import check_output_file, shown

#: GPU counts of ``--plot``, and the GPUs a node beyond the first.
SCALING_GPUS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
GPUS_PER_NODE = 8
#: The settings of ``lab2-train`` that change a plan: their flags, defaults and docs.
RUN_SETTINGS = ("grad_accum", "precision", "sharding", "ddp", "activation_checkpointing",
                "compile", "reshard_after_forward", "bucket_mb", "tp", "sequence_parallel",
                "optimizer")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit code 2
        print(f"lab2-train plan: error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_BAD_INPUT)


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``lab2-train``'s flags for the model and the run (the same
    fields, docs and choices; every default None, so that the field's default applies),
    the world's shape, the machine (:class:`Hardware`'s fields) and the output."""
    p = _Parser(prog="lab2-train plan", description="Predict a run's peak memory per GPU and "
                "its step time on N GPUs, before running it.")
    groups = {name: p.add_argument_group(name)
              for name in ("model", "run", "world", "machine", "output")}
    groups["model"].add_argument("--preset", choices=list(PRESETS), default="tiny",
                                 help="size preset (default tiny)")
    for cls, f in setting_fields():
        if cls is ModelConfig:
            add_setting_flag(groups["model"], cls, f)
        elif f.name in RUN_SETTINGS:
            add_setting_flag(groups["run"], cls, f)
    batch = groups["run"].add_mutually_exclusive_group()
    add_setting_flag(batch, TrainSettings, _field(TrainSettings, "batch_size"))
    batch.add_argument("--per-rank-batch", type=int, default=None,
                       help="sequences per rank and micro-batch (the global batch is this x "
                       "ranks x --grad-accum)")
    groups["world"].add_argument("--gpus-per-node", type=int, default=1)
    groups["world"].add_argument("--nodes", type=int, default=1)
    for f in dataclasses.fields(Hardware):
        add_setting_flag(groups["machine"], Hardware, f)
    out = groups["output"]
    out.add_argument("--compare", action="store_true",
                     help="also a row for every sharding kind x checkpointing kind")
    out.add_argument("--recommend", action="store_true",
                     help="also weigh every layout of these GPUs (--tp and --sequence-parallel, "
                     "sharding kind, checkpointing, the fewest micro-batches that fit) for this "
                     "model and global batch, and name the fastest that fits, with why")
    out.add_argument("--json", action="store_true", help="print the plan as JSON only")
    out.add_argument("--plot", metavar="FILE.png", default=None,
                     help="also draw step time and peak memory against the GPU count (1 to "
                     f"{max(SCALING_GPUS)}, {GPUS_PER_NODE} a node, this plan's per-rank "
                     "batch) for every sharding kind")
    return p


def _field(cls: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def _given(args: argparse.Namespace, cls: type, name: str) -> Any:
    """A flag's value, or its field's default when it was not given."""
    value = getattr(args, name)
    return _field(cls, name).default if value is None else value


def plan_input(args: argparse.Namespace) -> PlanInput:
    """The :class:`PlanInput` the flags describe (``ValueError`` for a bad combination)."""
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(ModelConfig)}
    model = model_config(args.preset, **overrides)
    for name in ("gpus_per_node", "nodes"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got "
                             f"{getattr(args, name)}")
    run = {name: _given(args, TrainSettings, name) for name in RUN_SETTINGS}
    # Left to the device, as by lab2-train: the GPU planned computes in bf16.
    for name in AUTO_SETTINGS:
        if run[name] in (AUTO, None):
            run[name] = device_defaults("cuda", bf16=True)[name]
    if run["grad_accum"] < 1:
        raise ValueError(f"--grad-accum must be >= 1, got {run['grad_accum']}")
    if run["tp"] < 1:
        raise ValueError(f"--tp must be >= 1, got {run['tp']}")
    dp = max(1, args.gpus_per_node * args.nodes // run["tp"])
    if args.per_rank_batch is not None:
        if args.per_rank_batch < 1:
            raise ValueError(f"--per-rank-batch must be >= 1, got {args.per_rank_batch}")
        batch = args.per_rank_batch * dp * run["grad_accum"]
    else:
        batch = _given(args, TrainSettings, "batch_size")
    hardware = Hardware(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Hardware)
                           if getattr(args, f.name) is not None})
    return PlanInput(model=model, batch_size=batch, gpus_per_node=args.gpus_per_node,
                     nodes=args.nodes, hardware=hardware, **run).validate()


def compare_rows(p: PlanInput) -> list[dict[str, Any]]:
    """One plan per sharding kind and checkpointing kind, the rest of ``p`` kept."""
    rows = []
    for sharding in SHARDING_KINDS:
        for kind in ACTIVATION_CHECKPOINTING:
            q = dataclasses.replace(p, sharding=sharding, ddp=None,
                                    activation_checkpointing=kind)
            result = plan(q)
            rows.append({"sharding": sharding, "activation_checkpointing": kind,
                         "peak_gib": result["peak_gib"], "fits": result["fits"],
                         "largest_micro_batch": result["largest_micro_batch"],
                         "step_s": result["time"]["step_s"],
                         "tokens_per_s": result["time"]["tokens_per_s"],
                         "mfu": result["time"]["mfu"],
                         "scaling_efficiency": result["time"]["scaling_efficiency"]})
    return rows


def scaling_rows(p: PlanInput) -> list[dict[str, Any]]:
    """Plans at every count of :data:`SCALING_GPUS` (:data:`GPUS_PER_NODE` a node once
    there are more), every sharding kind, this plan's micro-batch and the rest kept."""
    rows = []
    for gpus in SCALING_GPUS:
        per_node = min(gpus, GPUS_PER_NODE)
        for sharding in SHARDING_KINDS:
            q = dataclasses.replace(p, gpus_per_node=per_node, nodes=gpus // per_node,
                                    batch_size=p.micro_batch * gpus * p.grad_accum,
                                    sharding=sharding, ddp=None)
            result = plan(q)
            rows.append({"gpus": gpus, "sharding": sharding, "peak_gib": result["peak_gib"],
                         "step_s": result["time"]["step_s"],
                         "scaling_efficiency": result["time"]["scaling_efficiency"]})
    return rows


def draw(rows: list[dict[str, Any]], path: str, title: str, gpu_memory_gib: float) -> None:
    """Step time and peak memory against the GPU count, a line per sharding kind, written
    atomically to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lab2_trainer.runtime.run_folder import atomic_write

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for sharding in SHARDING_KINDS:
        mine = [r for r in rows if r["sharding"] == sharding]
        gpus = [r["gpus"] for r in mine]
        ax_t.plot(gpus, [r["step_s"] * 1e3 for r in mine], "o-", label=sharding, ms=3)
        ax_m.plot(gpus, [r["peak_gib"] for r in mine], "o-", label=sharding, ms=3)
    for ax, label in ((ax_t, "step time (ms), prediction"), (ax_m, "peak memory per GPU "
                                                                   "(GiB), prediction")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax_m.axhline(gpu_memory_gib, color="gray", ls="--", lw=1, label="GPU memory")
    ax_t.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    try:
        atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120))
    finally:
        plt.close(fig)


def count_text(n: float) -> str:
    """A count with its unit: ``1.97 B``, ``6.48 M``, ``3.2 K``, or the number itself."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f}"


def render(result: dict[str, Any], rows: list[dict[str, Any]] | None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    m = result["model"]
    mem, t = result["memory_bytes"], result["time"]
    title = (f"lab2-train plan: {count_text(result['parameters'])} parameters (d_model "
             f"{m['d_model']}, {m['n_layers']} layers, d_ff {m['d_ff']}, vocab "
             f"{m['vocab_size']}, context {m['context_length']}), {result['world_size']} GPU(s) "
             f"= {result['gpus_per_node']} x {result['nodes']} node(s), batch "
             f"{result['batch_size']} ({result['micro_batch']} per rank x "
             f"{result['grad_accum']} micro-batches), {result['precision']}, sharding "
             f"{result['sharding']}, activation checkpointing "
             f"{result['activation_checkpointing']}, "
             f"{'compiled' if result['compile'] else 'eager'}")
    table = Table(title="peak memory per GPU (prediction)", title_justify="left")
    table.add_column("item")
    table.add_column("GiB", justify="right")
    table.add_column("in the peak", justify="right")
    counted = {"gradients": mem["counted_gradients"] > 0}
    acts = mem["counted_activations"] > 0
    for name in ("parameters", "gradients", "optimizer", "sharding buffers",
                 "half-precision weight copies", "activations (blocks)",
                 "activations (final norm, loss)", "recomputed block",
                 "logits at backward start", "workspace"):
        inside = counted.get(name, acts if name.startswith(("activations", "recomputed",
                                                               "logits")) else True)
        table.add_row(name, f"{mem[name] / GIB:,.2f}", "yes" if inside else "no")
    table.add_row("[bold]peak allocated[/bold]", f"[bold]{mem['peak'] / GIB:,.2f}[/bold]", "")
    table.add_row("reserved (allocator)", f"{mem['reserved'] / GIB:,.2f}", "")
    verdict = ("[green]fits[/green]" if result["fits"] else "[red]does not fit[/red]")
    console.print(title)
    console.print(table)
    console.print(f"{verdict} in {result['gpu_memory_gib']:g} GiB per GPU; the largest "
                  f"micro-batch that fits: {result['largest_micro_batch']} sequences per rank")
    times = Table(title="step time (prediction)", title_justify="left")
    times.add_column("part")
    times.add_column("ms", justify="right")
    times.add_column("exposed ms", justify="right")
    times.add_row("compute (forward + backward + recompute)", f"{t['compute_s'] * 1e3:,.1f}",
                  f"{t['compute_s'] * 1e3:,.1f}")
    muon = t.get("muon")
    if muon is not None:
        times.add_row(f"Muon's Newton-Schulz ({muon['newton_schulz_flops'] / 1e12:,.1f} TFLOP "
                      "on the slowest rank)", f"{t['newton_schulz_s'] * 1e3:,.1f}",
                      f"{t['newton_schulz_s'] * 1e3:,.1f}")
    for name, comm in t["communication"].items():
        times.add_row(f"{name} ({comm['bytes'] / GIB:,.2f} GiB, hides behind "
                      f"{comm['hides_behind']})", f"{comm['seconds'] * 1e3:,.1f}",
                      f"{comm['exposed'] * 1e3:,.1f}")
    times.add_row("[bold]step[/bold]", f"[bold]{t['step_s'] * 1e3:,.1f}[/bold]", "")
    console.print(times)
    console.print(f"{t['tokens_per_s']:,.0f} tokens/s ({t['tokens_per_s_per_gpu']:,.0f} per "
                  f"GPU), MFU {t['mfu']:.1%}, HFU {t['hfu']:.1%}, scaling efficiency "
                  f"{t['scaling_efficiency']:.1%}; link: {t['link']}")
    if muon is not None:
        owned = ("every rank steps all of them" if muon["owner_ranks"] == 1 else
                 f"each on one of {muon['owner_ranks']} owner ranks, the busiest's "
                 f"{muon['elements'] / 1e6:,.1f} M elements counted")
        console.print(f"Muon's Newton-Schulz: {t['newton_schulz_s'] * 1e3:,.1f} ms of the "
                      f"step ({muon['share_of_step']:.0%}; {muon['matrices']} matrices, "
                      f"{owned})")
    ck = result["checkpoint_bytes"]
    console.print(f"checkpoint: {ck['total'] / 1e9:,.1f} GB a save; each rank copies its "
                  f"{ck['per_rank'] / 1e9:,.1f} GB to CPU memory and writes it; no rank "
                  "gathers a full copy")
    if rows:
        cmp = Table(title="every strategy (prediction)", title_justify="left")
        for col in ("sharding", "checkpointing", "peak GiB", "fits", "largest micro-batch",
                    "step ms", "tokens/s", "MFU", "scaling"):
            cmp.add_column(col, justify="left" if col in ("sharding", "checkpointing")
                           else "right")
        for r in rows:
            cmp.add_row(r["sharding"], r["activation_checkpointing"], f"{r['peak_gib']:,.1f}",
                        "yes" if r["fits"] else "no", str(r["largest_micro_batch"]),
                        f"{r['step_s'] * 1e3:,.1f}", f"{r['tokens_per_s']:,.0f}",
                        f"{r['mfu']:.1%}", f"{r['scaling_efficiency']:.1%}")
        console.print(cmp)
    console.print("assumptions:")
    for line in result["assumptions"]:
        console.print(f"  - {line}")


def strict_json(result: dict[str, Any]) -> str:
    """``result`` as strict JSON: a figure that is not finite (a prediction past what a
    float holds, from extreme hardware flags) is null, and ``non_finite`` lists where."""
    nulls: list[str] = []

    def clean(value: Any, where: str) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            nulls.append(where)
            return None
        if isinstance(value, dict):
            return {k: clean(v, f"{where}.{k}" if where else str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return value

    out = clean(result, "")
    if nulls:
        out["non_finite"] = nulls
        out.setdefault("assumptions", []).append(
            "null stands for a figure past what a float holds (infinite or undefined), from "
            "extreme inputs: see non_finite")
    return json.dumps(out, indent=2, allow_nan=False)


def _refuse(message: str, code: int = EXIT_BAD_INPUT) -> int:
    print(f"lab2-train plan: error: {message}", file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``lab2-train plan``; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        if args.plot is not None:  # absent or a regular file: never a device or a FIFO
            check_output_file(args.plot, "--plot")
        p = plan_input(args)
        result = plan(p)
        rows = compare_rows(p) if args.compare else None
        scaling = scaling_rows(p) if args.plot else None
        advice = recommend(p) if args.recommend else None
    except (ValueError, UsageError) as exc:
        return _refuse(str(exc))
    if rows is not None:
        result["compare"] = rows
    if advice is not None:
        result["recommendation"] = {k: advice[k] for k in ("best", "flags", "why", "by_tp")}
    if scaling is not None:
        result["scaling"] = scaling
        m = result["model"]
        try:
            draw(scaling, args.plot, f"lab2-train plan: d_model {m['d_model']}, "
                 f"{m['n_layers']} layers, {result['micro_batch']} x {m['context_length']} "
                 f"tokens per GPU, {result['precision']}, checkpointing "
                 f"{result['activation_checkpointing']}", result["gpu_memory_gib"])
        except OSError as exc:  # a read-only file system, a full disk, a swap meanwhile
            return _refuse(f"--plot {shown(args.plot)}: cannot write it "
                           f"({exc.strerror or exc}; nothing was written)", code=1)
    if args.json:
        print(strict_json(result))
    else:
        render(result, rows)
        if advice is not None:
            render_recommendation(result, advice)
    return 0


def render_recommendation(result: dict[str, Any], advice: dict[str, Any]) -> None:
    """The fastest layout of :func:`lab2_trainer.planner.layout.recommend`, why, and the
    best of each tensor-parallel size."""
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    if advice["best"] is None:
        console.print(f"[red]recommendation:[/red] {advice['why'][0]}")
        return
    table = Table(title=f"the fastest layout of each tensor-parallel size on "
                  f"{result['world_size']} GPU(s), batch {result['batch_size']} (prediction)",
                  title_justify="left")
    for col in ("tp x dp", "seq. parallel", "sharding", "checkpointing", "micro-batches",
                "peak GiB", "step ms", "exposed comm. ms", "MFU"):
        table.add_column(col, justify="left" if col in ("sharding", "checkpointing")
                         else "right")
    for r in advice["by_tp"]:
        table.add_row(f"{r['tp']} x {r['dp']}", "yes" if r["sequence_parallel"] else "no",
                      r["sharding"], r["activation_checkpointing"], str(r["grad_accum"]),
                      f"{r['peak_gib']:,.1f}", f"{r['step_s'] * 1e3:,.0f}",
                      f"{r['exposed_communication_s'] * 1e3:,.0f}", f"{r['mfu']:.1%}")
    console.print(table)
    console.print(f"[bold]recommended:[/bold] {advice['flags']}")
    for line in advice["why"]:
        console.print(f"  - {line}")
