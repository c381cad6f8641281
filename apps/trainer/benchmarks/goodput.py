"""Goodput of a long run that checkpoints: where ``lab2-train``'s wall clock goes, and how
long each checkpoint keeps training waiting, with the background write (``async``) and
with the write in the foreground (``sync``, ``--no-ckpt-async``).

    python apps/trainer/benchmarks/goodput.py                       # xl 32x512 on one GPU
    python apps/trainer/benchmarks/goodput.py --variants async,sync --rounds 1
    python apps/trainer/benchmarks/goodput.py --device cpu          # the plumbing, micro

Each run is the real command in a fresh process: ``lab2-train --preset xl --precision bf16
--compile --batch-size 32 --steps S --ckpt-every C --eval-every 0 --sample-tokens 0``. The
defaults, 1,620 steps and a checkpoint every 324, are a 10-minute run that checkpoints
every 2 minutes at xl's 44,300 tokens/s on one H200 (16,384 tokens a step). The variants
alternate in a balanced order over ``--rounds`` rounds. From each run's ``summary.json``:

* ``wall_s``, ``goodput`` (training steps / wall clock) and the split of the wall clock
  (``startup_s``, ``compilation_s``, ``training_s``, ``checkpoint_s``, ...);
* ``stalls_s``: what each checkpoint kept training waiting, and ``max_stall_s``; the last
  checkpoint is written at the end, where the run waits for it (``final_wait_s``, part of
  ``checkpoint_s``);
* ``checkpoint_gb``: the size of the last checkpoint folder.

``--out DIR`` writes ``goodput.jsonl`` (one record per run) and ``goodput.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = {"async": [], "sync": ["--no-ckpt-async"]}
COLUMNS = ["variant", "round", "wall_s", "goodput", "startup_s", "compilation_s",
           "training_s", "checkpoint_s", "saves", "max_stall_s", "final_wait_s",
           "checkpoint_gb"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--preset", default=None, help="default xl (micro sizes on the CPU)")
    p.add_argument("--batch-size", type=int, default=None, help="default 32 (4 on the CPU)")
    p.add_argument("--steps", type=int, default=None, help="default 1620 (8 on the CPU)")
    p.add_argument("--ckpt-every", type=int, default=None, help="default 324 (2 on the CPU)")
    p.add_argument("--variants", default="async", help="comma-separated: async, sync")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--no-compile", action="store_true", help="eager (compiled by default)")
    p.add_argument("--out", default=None, help="folder for goodput.jsonl and goodput.md")
    return p


def command(args: argparse.Namespace, variant: str, out: Path) -> list[str]:
    cpu = args.device == "cpu"
    cmd = [sys.executable, "-m", "lab2_trainer.cli", "--device", args.device, "--nproc", "1",
           "--batch-size", str(args.batch_size or (4 if cpu else 32)),
           "--steps", str(args.steps or (8 if cpu else 1620)),
           "--ckpt-every", str(args.ckpt_every or (2 if cpu else 324)),
           "--eval-every", "0", "--sample-tokens", "0", "--no-plot", "--quiet",
           "--log-every", "50", "--out", str(out), *VARIANTS[variant]]
    if cpu and args.preset is None:
        cmd += ["--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--d-ff", "64",
                "--context-length", "32", "--precision", "fp32"]
    else:
        cmd += ["--preset", args.preset or "xl", "--precision", "bf16"]
    if not args.no_compile and not cpu:
        cmd.append("--compile")
    return cmd


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def measure(args: argparse.Namespace, variant: str, round_: int, root: Path) -> dict:
    out = root / f"{variant}-{round_}"
    done = subprocess.run(command(args, variant, out), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{variant} round {round_} failed:\n{done.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    clock = summary["wall_clock"]
    stalls = summary["checkpoint_stalls"]
    last = Path(summary["outputs"]["checkpoint"])
    return {"variant": variant, "round": round_, **{k: clock[k] for k in (
                "wall_s", "goodput", "startup_s", "compilation_s", "training_s",
                "checkpoint_s")},
            "saves": len(stalls), "stalls_s": stalls, "max_stall_s": max(stalls, default=0.0),
            "final_wait_s": summary["checkpoint_final_wait_s"],
            "checkpoint_gb": folder_bytes(last) / 1e9, "step_tokens_per_s":
                summary.get("step_tokens_per_s"), "mfu": summary.get("mfu")}


def table(records: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in records:
        cells = [f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    records = []
    with tempfile.TemporaryDirectory(prefix="goodput-", dir=os.environ.get("TMPDIR")) as tmp:
        for round_ in range(args.rounds):
            order = variants if round_ % 2 == 0 else variants[::-1]
            for variant in order:
                records.append(measure(args, variant, round_, Path(tmp)))
                print(table(records[-1:]).splitlines()[-1], flush=True)
    text = table(records)
    print(text)
    for r in records:
        print(f"{r['variant']} round {r['round']}: stalls (s) "
              + ", ".join(f"{s:.3f}" for s in r["stalls_s"]))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "goodput.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (out / "goodput.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
