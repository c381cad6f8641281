"""The multi-GPU tables in one call: DDP, sharding and scaling over NCCL, one JSONL each.

Runs the benchmark scripts ``ddp.py``, ``zero.py`` and ``stack.py`` at every world size,
preset and per-rank batch asked for, each in its own launch, and gathers their records
into one JSONL per table under ``--out`` (each record keeps the command that made it),
then renders each table as Markdown beside it, with those commands:

    ddp.jsonl      every DDP variant against torch DDP: step, backward, exposed
                   communication (end of backward until the gradients are ready)
    zero.jsonl     every sharding kind: step, peak memory, bytes sent per rank
    stack.jsonl    our stacks against PyTorch's, compiled: tokens/s and MFU
    scaling.jsonl  tokens/s per GPU at each world size over one GPU's (from the stack runs;
                   world size 1 is added when it is not asked for)

One device call per machine kind:

    python apps/trainer/benchmarks/multi_gpu.py --world-sizes 2 --out OUT
    python apps/trainer/benchmarks/multi_gpu.py --quick --world-sizes 2 --out OUT  # CPU smoke

``--quick`` runs every suite's micro shapes on Gloo CPU ranks, to check the script, not to
measure anything.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

TABLES = ("ddp", "zero", "stack", "scaling")
#: Columns of each Markdown table (config first, then metrics; absent ones are left out).
COLUMNS = {
    "ddp": ["world_size", "preset", "batch_size", "variant", "bucket_rule", "step_ms",
            "backward_ms", "sync_wait_ms", "ratio_to_torch"],
    "zero": ["world_size", "preset", "batch_size", "variant", "step_ms", "sent_per_step_MiB",
             "sent_vs_params", "grad_MiB", "optim_state_MiB", "after_step_peak_MiB",
             "ratio_to_torch_zero"],
    "stack": ["world_size", "preset", "batch_size", "variant", "compiled", "step_ms",
              "tokens_per_s", "mfu", "ratio_to_pytorch"],
    "scaling": ["preset", "batch_size", "variant", "world_size", "tokens_per_s_per_gpu",
                "scaling_efficiency"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--world-sizes", default="2", help="comma-separated (default 2)")
    p.add_argument("--presets", default="small,medium,xl")
    p.add_argument("--batch-sizes", default="8,32", help="per rank, x context 512")
    p.add_argument("--tables", default=",".join(TABLES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="CPU smoke run of every table")
    args = p.parse_args(argv)
    args.world_sizes = [int(x) for x in args.world_sizes.split(",")]
    args.presets = args.presets.split(",")
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    args.tables = args.tables.split(",")
    bad = [t for t in args.tables if t not in TABLES]
    if bad or any(n < 1 for n in args.world_sizes):
        p.error(f"--tables from {', '.join(TABLES)}; --world-sizes >= 1")
    return args


def suite_runs(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(table, bench arguments) of every launch the tables need."""
    common = ["--quick", "--steps", "1"] if args.quick else [
        "--device", "cuda", "--precision", "bf16", "--context-length", "512",
        "--vocab-size", "10000", "--warmup", "3", "--steps", "10", "--rounds", str(args.rounds)]
    shapes = [[]] if args.quick else [
        ["--preset", preset, "--batch-size", str(b)]
        for preset in args.presets for b in args.batch_sizes]
    runs = []
    stack_sizes = sorted(set(args.world_sizes) | ({1} if "scaling" in args.tables else set()))
    for shape in shapes:
        for n in args.world_sizes:
            ws = ["--world-size", str(n)]
            if "ddp" in args.tables:
                for rule in ("reach", "at_most"):
                    variants = ("individual,bucketed,flat,naive,torch" if rule == "reach"
                                else "bucketed")
                    runs.append(("ddp", ["ddp", *common, *ws, *shape, "--bucket-mb", "25",
                                         "--bucket-rule", rule, "--variants", variants]))
            if "zero" in args.tables:
                runs.append(("zero", ["zero", *common, *ws, *shape]))
        for n in stack_sizes if {"stack", "scaling"} & set(args.tables) else []:
            compile_ = ["--compile", "--backend", "eager"] if args.quick else ["--compile"]
            runs.append(("stack", ["stack", *common, "--world-size", str(n), *shape, *compile_,
                                   "--variants", "ours,ours-zero2,pytorch,pytorch-fsdp-keep"]))
    return runs


def run_suite(table: str, bench_args: list[str], folder: Path) -> list[dict[str, Any]]:
    """One launch of a benchmark script; its records, each with its command."""
    folder.mkdir(parents=True, exist_ok=True)
    suite = bench_args[0]
    argv = ["python", f"apps/trainer/benchmarks/{suite}.py", *bench_args[1:], "--out", str(folder)]
    print("$", shlex.join(argv), flush=True)
    subprocess.run([sys.executable, str(Path(__file__).parent / f"{suite}.py"), *argv[2:]],
                   check=True)
    from lab2bench import read_records

    records = read_records(folder / f"{suite}.jsonl")
    for r in records:
        r["command"] = shlex.join(argv[:-2])  # without the scratch --out
    return records


def flat(record: dict[str, Any]) -> dict[str, Any]:
    return {**record["config"], **record["metrics"], "command": record.get("command", "")}


def scaling_rows(stack: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tokens/s per GPU at every world size over one GPU's, per (preset, batch, stack)."""
    rows = [flat(r) for r in stack]
    one = {(r["preset"], r["batch_size"], r["variant"]): r["tokens_per_s"]
           for r in rows if r["world_size"] == 1}
    out = []
    for r in rows:
        per_gpu = r["tokens_per_s"] / r["world_size"]
        base = one.get((r["preset"], r["batch_size"], r["variant"]))
        out.append({"preset": r["preset"], "batch_size": r["batch_size"],
                    "variant": r["variant"], "world_size": r["world_size"],
                    "tokens_per_s_per_gpu": per_gpu,
                    "scaling_efficiency": per_gpu / base if base else None,
                    "command": r["command"]})
    return out


def markdown(table: str, rows: list[dict[str, Any]]) -> str:
    from lab2bench import markdown_table

    cols = [c for c in COLUMNS[table] if any(c in r for r in rows)]
    commands = list(dict.fromkeys(r["command"] for r in rows))
    return "\n".join([f"## {table}", "", markdown_table(rows, cols), "```bash", *commands,
                      "```", ""])


def main(argv: list[str] | None = None) -> int:
    from lab2bench import atomic_write_text, write_jsonl

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    got: dict[str, list[dict[str, Any]]] = {t: [] for t in TABLES}
    for i, (table, bench_args) in enumerate(suite_runs(args)):
        got[table] += run_suite(table, bench_args, args.out / "runs" / f"{i:02d}-{table}")
    tables = {t: [flat(r) for r in got[t]] for t in ("ddp", "zero", "stack")}
    tables["scaling"] = scaling_rows(got["stack"])
    for table in args.tables:
        rows = tables[table]
        write_jsonl(args.out / f"{table}.jsonl", rows)
        atomic_write_text(args.out / f"{table}.md", markdown(table, rows))
        print(markdown(table, rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
