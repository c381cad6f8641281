"""What rank 0 shows and writes (progress bar, log lines, metrics.jsonl, loss curve,
summary), and the model FLOPs utilisation it reports.

**Model FLOPs utilisation**: the FLOPs a training step must do (model FLOPs per token,
:func:`lab2_trainer.models.shapes.training_flops_per_token`: ``6 N + 12 n_layers d_model
context_length``), over what the GPU could do. Recomputed activations, the optimizer and
the norms are not counted: MFU measures useful work.

The peak is the GPU's dense bf16 tensor throughput from the table :data:`PEAKS`, found by
the device's name; on the CPU or an unknown GPU there is no peak, and MFU is reported as
absent rather than guessed.

Hardware FLOPs utilisation (HFU) counts what the GPU really computes, recomputation
included: with activation checkpointing, the recomputed blocks' forwards are added to the
model FLOPs (:func:`recompute_flops_per_token`). Without recomputation HFU equals MFU.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from torch import nn

from lab2_trainer.config import ModelConfig
from lab2_trainer.models.activation_checkpointing import recomputed_blocks
from lab2_trainer.models.shapes import recompute_flops
from lab2_trainer.runtime.run_folder import atomic_write, atomic_write_text
from lab2_trainer.runtime.wall_clock import describe as describe_wall_clock

METRICS_NAME = "metrics.jsonl"
PLOT_NAME = "loss_curve.png"
SAMPLE_NAME = "sample.txt"
SUMMARY_NAME = "summary.json"
#: Console width off a terminal (a log file, a pipe): wide enough that no log line is wrapped
#: and no path in the summary is cut, as rich's default of 80 columns would.
LOG_WIDTH = 10_000


def bytes_as_text(data: bytes) -> str:
    """``data`` as UTF-8 text to print: undecodable bytes become ``\\xNN`` escapes, and so do
    control characters other than newline and tab (a sample must not drive the terminal)."""
    text = data.decode("utf-8", errors="backslashreplace")
    return "".join(ch if ch in "\n\t" or unicodedata.category(ch)[0] != "C"
                   else ascii(ch)[1:-1] for ch in text)


#: Distributions whose versions summary.json records (None: not installed).
VERSIONED = ("lab2-trainer", "tritonnorm", "minddp", "zero1", "torch", "triton")


def provenance() -> dict[str, Any]:
    """What a run ran on, for summary.json: ``versions`` of :data:`VERSIONED` (read from
    the installed metadata, so nothing is imported) and ``git``, the working directory's
    checkout (``{"commit", "dirty"}``, or None outside one)."""
    versions: dict[str, str | None] = {}
    for name in VERSIONED:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {"versions": versions, "git": git_commit()}


def git_commit() -> dict[str, Any] | None:
    """``{"commit": sha, "dirty": bool}`` of the git checkout holding the working
    directory; None outside one, or without git."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout

    try:
        sha = git("rev-parse", "HEAD").strip()
        dirty = bool(git("status", "--porcelain", "--untracked-files=no").strip())
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": sha, "dirty": dirty}


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file (a torn last line is skipped)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class RunReporter:
    """Rank 0's console and files for one run.

    Args:
        out: output folder (exists).
        total_steps: steps of the whole run.
        start_step: first step of this invocation (non-zero on resume).
        quiet: no bar and no per-step console lines.
        log_every: steps between log lines when the console is not a terminal.
    """

    def __init__(self, out: Path, total_steps: int, start_step: int, *, quiet: bool,
                 log_every: int) -> None:
        self.out = out
        self.console = Console(stderr=False, highlight=False)
        if not self.console.is_terminal:
            self.console = Console(stderr=False, highlight=False, width=LOG_WIDTH)
        self.quiet = quiet
        self.log_every = log_every
        self.metrics_path = out / METRICS_NAME
        # A resumed run keeps the records up to its checkpoint and drops any later ones
        # (written by the interrupted run after that checkpoint).
        kept = [r for r in read_metrics(self.metrics_path) if r.get("step", 0) <= start_step]
        atomic_write_text(self.metrics_path, "".join(json.dumps(r) + "\n" for r in kept))
        self.history = kept
        self._file = open(self.metrics_path, "a", buffering=1)  # noqa: SIM115 (closed in close())
        self.progress: Progress | None = None
        if not quiet and self.console.is_terminal:
            # A bar that cannot advance before the run ends (one step to go) would sit at 0%.
            advances = total_steps - start_step > 1
            self.progress = Progress(
                *([TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn()] if advances
                  else [SpinnerColumn(), TextColumn("[bold]train")]),
                TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                console=self.console, transient=False,
            )
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step,
                                               info="")
            self.progress.start()

    def print(self, *args: Any) -> None:
        """A console line (above the bar when one is showing)."""
        self.console.print(*args)

    def step(self, record: dict[str, Any]) -> None:
        """Record one step's metrics (one JSON line) and update the bar."""
        self._file.write(json.dumps(record) + "\n")
        self.history.append(record)
        info = (f"loss {record['loss']:.3f}  lr {record['lr']:.2e}  "
                f"{record['tokens_per_s']:,.0f} tok/s")
        if record.get("mfu") is not None:
            info += f"  MFU {record['mfu']:.1%}"
            if record.get("hfu") is not None and record["hfu"] != record["mfu"]:
                info += f"  HFU {record['hfu']:.1%}"
        if "val_loss" in record:
            self.print(f"step {record['step']:>6}  val loss {record['val_loss']:.4f}  "
                       f"ppl {record['val_ppl']:.2f}")
        if self.progress is not None:
            self.progress.update(self.task, completed=record["step"], info=info)
        elif not self.quiet and record["step"] % self.log_every == 0:
            self.print(f"step {record['step']:>6}  {info}")

    def close(self) -> None:
        """Stop the bar and close the metrics file."""
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        self._file.close()

    def plot(self, unigram_entropy: float | None,
             compression: dict[str, float] | None = None) -> Path | None:
        """Training and validation loss against step, with the unigram entropy and the
        compressors' figures (:func:`lab2_trainer.data.corpus.compression_baselines`) as lines."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        steps = [r["step"] for r in self.history]
        losses = [r["loss"] for r in self.history]
        val = [(r["step"], r["val_loss"]) for r in self.history if "val_loss" in r]
        fig, ax = plt.subplots(figsize=(7, 4.2))
        ax.plot(steps, losses, lw=1, label="train loss")
        if val:
            ax.plot(*zip(*val), "o-", label="validation loss")
        if unigram_entropy is not None:
            ax.axhline(unigram_entropy, color="gray", ls="--", label="unigram entropy")
        for (name, figure), style in zip((compression or {}).items(), (":", "-.")):
            ax.axhline(figure, color="black", ls=style, lw=1, label=f"{name} (validation)")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats / token)")
        ax.set_title("lab2-train loss")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = self.out / PLOT_NAME
        try:
            atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120))
        finally:
            plt.close(fig)
        return path

    def summary(self, summary: dict[str, Any], outputs: dict[str, str]) -> None:
        """Write summary.json and print the final figures and where every output went."""
        summary = dict(summary, outputs=outputs)
        atomic_write_text(self.out / SUMMARY_NAME, json.dumps(summary, indent=2) + "\n")
        table = Table(title="lab2-train summary", show_header=False, title_justify="left")
        table.add_column(style="bold")
        table.add_column()
        val, ent = summary.get("final_val_loss"), summary.get("unigram_entropy")
        if val is not None:
            table.add_row("final val loss", f"{val:.4f} nats/token (perplexity "
                                            f"{math.exp(min(val, 50)):.2f})")
        if ent is not None:
            table.add_row("unigram entropy", f"{ent:.4f} nats/token (byte frequencies of train)")
        if val is not None and ent:
            table.add_row("val / unigram", ratio_text(val / ent))
        if val is not None and summary.get("compression"):
            table.add_row("compressors", compression_text(val, summary["compression"]))
        table.add_row("steps", f"{summary['steps']} ({summary['tokens']:,} tokens)")
        table.add_row("wall time", f"{summary['train_seconds']:.1f} s training "
                                   f"({summary['tokens_per_s']:,.0f} tokens/s)")
        if summary.get("wall_clock"):
            table.add_row("wall clock", describe_wall_clock(summary["wall_clock"]))
        if summary.get("mfu") is not None:
            table.add_row("MFU", f"{summary['mfu']:.1%} of {summary['mfu_peak']} "
                                 f"({summary['step_tokens_per_s']:,.0f} tokens/s in steps)")
            if summary.get("hfu") is not None:
                table.add_row("HFU", f"{summary['hfu']:.1%} (hardware FLOPs: the model's "
                                     "and the recomputed forwards)")
        elif "mfu" in summary:
            table.add_row("MFU", "not reported (no known bf16 peak for this device)")
        if summary.get("settings"):
            table.add_row("precision", precision_text(summary["settings"]))
        table.add_row("setup", summary["setup"])
        for name, path in outputs.items():
            table.add_row(name, path)
        self.print(table)


def precision_text(settings: dict[str, Any]) -> str:
    """The run's precision and compilation, "(auto)" after each the device chose (settings
    as ``TrainSettings.to_dict``): ``"bf16 (auto), compile blocks (auto)"``."""
    chosen = str(settings.get("auto") or "").split(",")

    def mark(name: str) -> str:
        return " (auto)" if name in chosen else ""

    compiled = (f"compile {settings.get('compile_scope', 'blocks')}" if settings.get("compile")
                else "no compile")
    precision = precision_name(settings.get("precision"), settings.get("fp8_recipe"))
    return f"{precision}{mark('precision')}, {compiled}{mark('compile')}"


def precision_name(precision: Any, fp8_recipe: Any = None) -> str:
    """The precision as a run shows it: with fp8 its recipe too (``"fp8 (tensorwise)"``;
    runs saved before the recipe existed show none)."""
    if precision == "fp8" and fp8_recipe:
        return f"fp8 ({fp8_recipe})"
    return str(precision)


def ratio_text(ratio: float) -> str:
    """The validation loss over the unigram entropy, and how far below (or above) it is."""
    if math.isclose(ratio, 1.0, abs_tol=5e-4):
        return f"{ratio:.3f} (equal to the unigram entropy)"
    where = "below" if ratio < 1 else "above"
    return f"{ratio:.3f} ({abs(1 - ratio) * 100:.1f}% {where} the unigram entropy)"


def compression_text(val: float, compression: dict[str, float]) -> str:
    """The compressors' figures on the validation split, and where the loss stands
    against the best of them."""
    figures = ", ".join(f"{name} {figure:.4f}" for name, figure in compression.items())
    name, best = min(compression.items(), key=lambda item: item[1])
    where = "below" if val < best else "above"
    return (f"{figures} nats/token on the validation split: the val loss is "
            f"{abs(1 - val / best) * 100:.1f}% {where} {name}'s")


# ------------------------------------------------------------- model FLOPs utilisation
@dataclass(frozen=True)
class Peak:
    """A device's dense bf16 peak: its name in reports and FLOP/s."""

    name: str
    flops: float


#: Dense (no sparsity) bf16 tensor-core peaks, from the vendors' data sheets, matched as
#: substrings of ``torch.cuda.get_device_name()``, first match wins (the more specific
#: names come first).
PEAKS: list[tuple[str, Peak]] = [
    ("H100 PCIe", Peak("NVIDIA H100 PCIe, dense bf16", 756e12)),
    ("H100 NVL", Peak("NVIDIA H100 NVL, dense bf16", 835e12)),
    ("H200", Peak("NVIDIA H200 SXM, dense bf16", 989e12)),
    ("H100", Peak("NVIDIA H100 SXM, dense bf16", 989e12)),
    ("H800", Peak("NVIDIA H800 SXM, dense bf16", 989e12)),
    ("B200", Peak("NVIDIA B200, dense bf16", 2250e12)),
    ("A100", Peak("NVIDIA A100, dense bf16", 312e12)),
    ("A800", Peak("NVIDIA A800, dense bf16", 312e12)),
    ("L40S", Peak("NVIDIA L40S, dense bf16", 362e12)),
]


def peak_for_name(name: str) -> Peak | None:
    """The table's peak for a device name, or None when the name is not in it."""
    for key, peak in PEAKS:
        if key in name:
            return peak
    return None


def device_peak(device: torch.device | str) -> Peak | None:
    """The dense bf16 peak of ``device``: None on the CPU or on a GPU not in :data:`PEAKS`."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_for_name(torch.cuda.get_device_name(device))


def device_label(device: torch.device | str) -> str:
    """The device's name as reports show it ("cpu", or the GPU's name)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type


def matmul_parameters(model: nn.Module) -> int:
    """Parameters taking part in matrix products (the ``N`` of
    :mod:`lab2_trainer.models.shapes`) of a ``TransformerLM``."""
    total = sum(p.numel() for p in model.parameters())  # a tied weight comes once
    total -= model.pos_emb.weight.numel()
    if model.lm_head.weight is not model.tok_emb.weight:
        total -= model.tok_emb.weight.numel()
    return total


def recompute_flops_per_token(config: ModelConfig, activation_checkpointing: str) -> float:
    """Forward FLOPs per token that activation checkpointing runs again in backward: the
    recomputed blocks' matrix products and attention products (none for "none" and for
    the op-level "selective" policy, which recomputes only elementwise work)."""
    blocks = recomputed_blocks(activation_checkpointing, config.n_layers)
    return recompute_flops(config, blocks)


def mfu(tokens_per_s: float, flops_per_token: float, peak: Peak | None,
        devices: int = 1) -> float | None:
    """The fraction of ``devices`` x the peak that ``tokens_per_s`` uses; None without a peak.

    Args:
        tokens_per_s: tokens processed per second over all devices.
        flops_per_token: from :func:`lab2_trainer.models.shapes.training_flops_per_token` (a
            third of it for forwards).
        peak: the device's peak (None gives None).
        devices: how many devices shared the tokens.
    """
    if peak is None or not tokens_per_s > 0:
        return None
    return tokens_per_s * flops_per_token / (peak.flops * devices)
