"""Time to first step and steady-state MFU of regional compilation (``--compile-scope
blocks``, each block compiled on its own) against whole-model compilation (``model``), on
one GPU.

    python apps/trainer/benchmarks/compile_time.py --config xl:32x512 --rounds 2
    python apps/trainer/benchmarks/compile_time.py --config xl:32x512:selective \
        --scopes blocks,model,eager
    python apps/trainer/benchmarks/compile_time.py --device cpu  # the plumbing, micro model

Every measurement is a fresh process with an empty inductor cache (its own
``TORCHINDUCTOR_CACHE_DIR``), as a user's first run is. The scopes alternate in a balanced
order (blocks, model, then model, blocks, ...) for ``--rounds`` rounds, so the runs of one
scope are each other's A/A control and a slow spell of the machine falls on both. A run
builds the trainer's model on the GPU (``--vocab-size`` 256: ``lab2-train``'s byte data),
sets it up as the trainer does (``harness.setup``: the compilation of ``--scope``, then
``--stack``'s wrapper or sharding, then fused AdamW), and takes training steps in bf16:

* ``first_step_s``: the first step, to its end on the device (tracing, code generation,
  autotuning, the first launches);
* ``time_to_first_step_s``: from the process's launch (interpreter and imports included)
  to the end of that step;
* ``compile_s``: the first step less a steady step;
* after ``--warmup`` more steps, ``--windows`` windows of ``--steps`` back-to-back steps
  between CUDA events, the best kept: ``step_ms``, tokens/s, ``mfu`` (``report.mfu``);
* ``graphs``: the graphs dynamo compiled (``unique_graphs``);
* ``dynamo_compile_s``: dynamo's own account of its compile time (its
  ``compilation_time_metrics``: the frames' compiles and the backward's, which is compiled
  at the first backward), where this torch keeps it: a check on ``compile_s``.

``blocks+optimizer`` also compiles AdamW's step (the for-each arithmetic fused by inductor,
the learning rate a tensor) in place of the fused AdamW kernels, to see whether compiling
the optimizer pays: a faster step against a longer first one.

The table's last rows give each scope's mean and spread (max - min over its rounds) and the
ratio of every scope to ``blocks``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lab2_trainer.config import ACTIVATION_CHECKPOINTING, PRESETS

#: What each scope runs: the trainer's --compile-scope, no compilation ("eager"), or the
#: blocks and AdamW's step compiled too ("blocks+optimizer", --stack none only).
SCOPES = ("blocks", "model", "eager", "blocks+optimizer")
#: --stack: the trainer's --ddp and --sharding (the default: one GPU's, as lab2-train sets).
STACKS = {"none": ("none", "none"), "zero1": ("none", "zero1"),
          "fsdp": ("none", "fsdp")}
COLUMNS = ["scope", "round", "time_to_first_step_s", "first_step_s", "compile_s",
           "dynamo_compile_s", "step_ms", "tokens_per_s", "mfu", "graphs"]
SUMMARY_COLUMNS = ["scope", "runs", "time_to_first_step_s", "spread_s", "compile_s",
                   "step_ms", "mfu", "mfu_spread", "first_step_vs_blocks", "mfu_vs_blocks"]


def parse_config(p: argparse.ArgumentParser, text: str) -> dict:
    """``preset:BATCHxCONTEXT[:none|full|selective]``."""
    parts = text.split(":")
    preset, shape = (parts + [""])[:2]
    kind = parts[2] if len(parts) > 2 else "none"
    batch, _, context = shape.partition("x")
    if len(parts) > 3 or preset not in (*PRESETS, "micro") or kind not in \
            ACTIVATION_CHECKPOINTING or not (batch.isdigit() and context.isdigit()) or \
            min(int(batch), int(context)) < 1:
        p.error(f"bad configuration {text!r}: want preset:BATCHxCONTEXT[:none|full|selective]")
    return dict(preset=preset, batch=int(batch), context=int(context), kind=kind)


def measure(args: argparse.Namespace) -> dict:
    """One run of ``args.scope`` in this process (a child of :func:`main`)."""
    import harness
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    from lab2_trainer.models.shapes import training_flops_per_token
    from lab2_trainer.reporting.report import device_peak, matmul_parameters, mfu
    from lab2bench.timing import measure as measure_time

    cfg = parse_config(argparse.ArgumentParser(), args.config)
    cuda = args.device == "cuda"
    device = harness.single_rank_group(cuda)
    config = harness.build_config(cfg["preset"], context_length=cfg["context"],
                                  vocab_size=args.vocab_size)
    model = harness.build_model(config, device, seed=0)
    model.activation_checkpointing = cfg["kind"]
    ddp, sharding = STACKS[args.stack]
    compiled = None if args.scope == "eager" else {
        "backend": args.backend, "mode": args.compile_mode, "scope": args.scope.split("+")[0]}
    variant = harness.setup(model, sharding, device, ddp=ddp, compile=compiled)
    if args.scope.endswith("+optimizer"):
        variant.optimizer = compiled_adamw(model, args)
    batches = [harness.random_batch(config, cfg["batch"], device, seed=i) for i in range(2)]

    def step(i: int) -> None:
        harness.step_marks(variant, batches[i % 2], "bf16", device)

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize()

    synchronize()
    start = time.perf_counter()
    step(0)
    synchronize()
    first_step_s = time.perf_counter() - start
    time_to_first_step_s = time.time() - args.launched
    for i in range(args.warmup):
        step(i + 1)
    windows = [s / args.steps for s in measure_time(
        lambda: [step(i) for i in range(args.steps)], warmup=0, repeats=args.windows,
        device=device).samples]
    step_s = min(windows)
    tokens_per_s = cfg["batch"] * config.context_length / step_s
    flops = training_flops_per_token(config, matmul_parameters(model))
    torch.distributed.destroy_process_group()
    return {"time_to_first_step_s": time_to_first_step_s, "first_step_s": first_step_s,
            "compile_s": max(0.0, first_step_s - step_s), "step_ms": step_s * 1e3,
            "windows_ms": [w * 1e3 for w in windows], "tokens_per_s": tokens_per_s,
            "mfu": mfu(tokens_per_s, flops, device_peak(device)),
            "graphs": counters["stats"]["unique_graphs"], "dynamo_compile_s": dynamo_seconds()}


def dynamo_seconds() -> float | None:
    """Seconds dynamo says it spent compiling (forward frames and lazily compiled
    backwards); None where this torch does not keep them under these names."""
    from torch._dynamo import utils

    metrics = getattr(utils, "compilation_time_metrics", {})
    keys = [k for k in ("_compile.compile_inner", "backward._backward_impl") if k in metrics]
    return sum(sum(metrics[k]) for k in keys) if keys else None


def compiled_adamw(model, args: argparse.Namespace):
    """The trainer's AdamW (its groups and hyperparameters) with ``step`` compiled: the
    for-each arithmetic traced and fused by inductor, in place of the fused kernels; the
    learning rate a tensor, so that a schedule changing it does not recompile."""
    import harness
    import torch

    from lab2_trainer.parallel.parallelize import param_groups

    hyper = harness.adamw(next(model.parameters()).device)
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(param_groups(model, hyper["weight_decay"]),
                                  lr=torch.tensor(hyper["lr"], device=device),
                                  betas=hyper["betas"], eps=1e-8)
    optimizer.step = torch.compile(optimizer.step, backend=args.backend,
                                   mode=args.compile_mode)
    return optimizer


def run_child(args: argparse.Namespace, scope: str) -> dict:
    """One fresh process measuring ``scope``, with an empty inductor cache."""
    with tempfile.TemporaryDirectory(prefix="lab2-compile-time-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": cache}
        command = [sys.executable, __file__, "--child", "--scope", scope, "--launched",
                   repr(time.time()), *args.passed]
        done = subprocess.run(command, capture_output=True, text=True, env=env,
                              timeout=args.timeout)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
        return {"error": f"exit {done.returncode}: {tail[0]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarise(rows: list[dict], scopes: list[str]) -> list[dict]:
    """Each scope's mean and spread over its rounds, and its ratios to ``blocks``."""
    out = []
    for scope in scopes:
        good = [r for r in rows if r["scope"] == scope and "error" not in r]
        if not good:
            continue

        def mean(key: str, good: list[dict] = good) -> float | None:
            values = [r[key] for r in good if r.get(key) is not None]
            return statistics.fmean(values) if values else None

        first = [r["time_to_first_step_s"] for r in good]
        mfus = [r["mfu"] for r in good if r.get("mfu") is not None]
        out.append({"scope": scope, "runs": len(good), "time_to_first_step_s": mean(
            "time_to_first_step_s"), "spread_s": max(first) - min(first),
            "compile_s": mean("compile_s"), "step_ms": mean("step_ms"), "mfu": mean("mfu"),
            "mfu_spread": max(mfus) - min(mfus) if mfus else None})
    base = next((r for r in out if r["scope"] == "blocks"), None)
    for r in out:
        if base is not None:
            r["first_step_vs_blocks"] = r["time_to_first_step_s"] / base["time_to_first_step_s"]
            if r["mfu"] is not None and base["mfu"]:
                r["mfu_vs_blocks"] = r["mfu"] / base["mfu"]
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None,
                   help="preset:BATCHxCONTEXT[:none|full|selective] (default xl:32x512; "
                        "micro:2x16 with --device cpu)")
    p.add_argument("--scopes", default="blocks,model",
                   help=f"comma-separated, from {', '.join(SCOPES)} (eager: not compiled)")
    p.add_argument("--rounds", type=int, default=2, help="runs of every scope")
    p.add_argument("--stack", choices=list(STACKS), default="none",
                   help="the trainer's sharding (none: one GPU's default)")
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--backend", default=None,
                   help="torch.compile backend (default inductor; aot_eager on the CPU)")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the first")
    p.add_argument("--steps", type=int, default=None, help="steps per window (default 8)")
    p.add_argument("--windows", type=int, default=None, help="timed windows (default 3)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: the plumbing on a micro model (times only)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--out", default=None, help="folder for compile_time.jsonl and .md")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--scope", choices=SCOPES, help=argparse.SUPPRESS)
    p.add_argument("--launched", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cpu = args.device == "cpu"
    args.config = args.config or ("micro:2x16" if cpu else "xl:32x512")
    args.backend = args.backend or ("aot_eager" if cpu else "inductor")
    args.steps = args.steps or (2 if cpu else 8)
    args.windows = args.windows or (1 if cpu else 3)
    if args.child:
        print(json.dumps(measure(args)), flush=True)
        return 0
    parse_config(p, args.config)
    scopes = [s for s in args.scopes.split(",") if s]
    bad = [s for s in scopes if s not in SCOPES]
    if bad or not scopes:
        p.error(f"unknown scope(s) {', '.join(bad)}; choose from {', '.join(SCOPES)}")
    if "blocks+optimizer" in scopes and args.stack != "none":
        p.error("blocks+optimizer compiles plain AdamW's step: it needs --stack none")
    if args.rounds < 1 or args.steps < 1 or args.windows < 1 or args.warmup < 0:
        p.error("--rounds, --steps and --windows must be >= 1, --warmup >= 0")
    if not cpu:
        import torch

        if not torch.cuda.is_available():
            p.error("no CUDA GPU (--device cpu runs the plumbing on a micro model)")
    # What every child is given: the options, resolved.
    args.passed = ["--config", args.config, "--stack", args.stack, "--vocab-size",
                   str(args.vocab_size), "--backend", args.backend, "--warmup",
                   str(args.warmup), "--steps", str(args.steps), "--windows",
                   str(args.windows), "--device", args.device,
                   *(["--compile-mode", args.compile_mode] if args.compile_mode else [])]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import harness

    out = harness.Output("compile_time", args.out)
    for rnd in range(args.rounds):
        order = scopes if rnd % 2 == 0 else scopes[::-1]  # balanced: ABBA...
        for scope in order:
            row = run_child(args, scope)
            out.add({"config": args.config, "stack": args.stack, "scope": scope,
                     "round": rnd + 1, "backend": args.backend,
                     "compile_mode": args.compile_mode}, row)
            print({k: v for k, v in out.rows[-1].items() if k in COLUMNS or k == "error"},
                  file=sys.stderr, flush=True)
    title = (f"compile_time: {args.config}, stack {args.stack}, bf16, {args.backend}, "
             f"vocabulary {args.vocab_size}, a fresh process and inductor cache per run, best of "
             f"{args.windows} window(s) of {args.steps} steps after {args.warmup + 1}")
    out.table(COLUMNS, title)
    out.table(SUMMARY_COLUMNS, "per scope: mean over its runs, spread = max - min",
              rows=summarise(out.rows, scopes))
    out.finish()
    return 1 if any("error" in r for r in out.rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
