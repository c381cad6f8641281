"""The planner against measurements: peak memory and step time of real training steps on one
GPU beside ``lab2-train plan``'s prediction for the same run, and the error of each.

    python apps/trainer/benchmarks/plan_check.py --out runs/plan-check

Each configuration is ``preset:BATCHxCONTEXT:eager|compiled:none|full|selective`` (the
default list runs in under 5 minutes on an H200: a configuration starts only while
``--budget-s`` leaves it time). A
step is what the trainer's step is on one GPU without sharding: bf16 autocast, forward and
backward, fused AdamW (two parameter groups), gradients set to None. The peak is
``torch.cuda.max_memory_allocated`` over the timed steps (after the warm-up steps, which
allocate AdamW's state), the step time the mean of ``--steps`` steps between CUDA events.
Writes ``plan_check.jsonl`` (one record a configuration) and ``plan_check.md`` to ``--out``.
``--device cpu`` runs the plumbing on a micro model (times only, no memory figures).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path

import torch
import torch._dynamo

from lab2_trainer.config import ACTIVATION_CHECKPOINTING, PRESETS, model_config
from lab2_trainer.model import TransformerLM
from lab2_trainer.parallel import build_optimizer
from lab2_trainer.plan import GIB, Hardware, PlanInput, plan
from lab2_trainer.report import device_label, device_peak
from lab2bench.records import atomic_write_text

DEFAULT_CONFIGS = [
    "medium:8x512:eager:none", "medium:8x512:eager:full", "medium:8x512:eager:selective",
    "xl:8x512:eager:none", "xl:32x512:eager:full", "xl:32x512:compiled:none",
    "medium:32x512:compiled:none", "medium:32x512:compiled:selective",
]
#: Seconds of --budget-s a configuration needs left to start (compiling takes a while).
NEEDS = {"eager": 15.0, "compiled": 90.0}


def parse_config(spec: str) -> dict:
    try:
        preset, shape, mode, kind = spec.split(":")
        batch, context = (int(v) for v in shape.split("x"))
    except ValueError:
        raise SystemExit(f"plan_check.py: bad configuration {spec!r}: want "
                         "preset:BATCHxCONTEXT:eager|compiled:none|full|selective") from None
    if preset not in PRESETS or mode not in ("eager", "compiled") \
            or kind not in ACTIVATION_CHECKPOINTING or batch < 1 or context < 1:
        raise SystemExit(f"plan_check.py: bad configuration {spec!r}")
    return dict(spec=spec, preset=preset, batch=batch, context=context,
                compiled=mode == "compiled", kind=kind)


def measure(cfg: dict, args, device: torch.device) -> dict:
    config = model_config(cfg["preset"], context_length=cfg["context"],
                          vocab_size=args.vocab_size)
    if device.type == "cpu":
        config = dataclasses.replace(config, d_model=32, n_layers=2, n_heads=2, d_ff=64,
                                     norm="torch")
    model = TransformerLM(config, device=device, activation_checkpointing=cfg["kind"])
    optimizer = build_optimizer(model, "none", lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                fused=device.type == "cuda")
    forward = torch.compile(model) if cfg["compiled"] else model
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randint(0, config.vocab_size, (cfg["batch"], config.context_length),
                      device=device, generator=gen)
    y = x.roll(-1, 1)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            _, loss = forward(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    start = time.perf_counter()
    for _ in range(args.warmup):
        step()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    if cuda:
        end.record()
        torch.cuda.synchronize()
        step_s = begin.elapsed_time(end) / 1e3 / args.steps
        peak = torch.cuda.max_memory_allocated()
    else:
        step_s = (time.perf_counter() - t0) / args.steps
        peak = None
    setup_s = time.perf_counter() - start - step_s * args.steps
    peak_flops = device_peak(device)
    hardware = Hardware(peak_tflops=peak_flops.flops / 1e12) if peak_flops else Hardware()
    predicted = plan(PlanInput(config, batch_size=cfg["batch"], precision="bf16",
                               sharding="none", activation_checkpointing=cfg["kind"],
                               compile=cfg["compiled"], hardware=hardware))
    record = {
        "config": cfg["spec"], "parameters": predicted["parameters"],
        "device": device_label(device),
        "measured_peak_gib": None if peak is None else peak / GIB,
        "predicted_peak_gib": predicted["peak_gib"],
        "measured_step_ms": step_s * 1e3,
        "predicted_step_ms": predicted["time"]["step_s"] * 1e3,
        "setup_s": setup_s,
    }
    if peak is not None:
        record["peak_error"] = predicted["peak_gib"] / record["measured_peak_gib"] - 1
        tokens = cfg["batch"] * config.context_length
        flops = predicted["time"]["model_flops_per_token"]
        record["measured_mfu"] = tokens / step_s * flops / (hardware.peak_tflops * 1e12)
    record["step_error"] = record["predicted_step_ms"] / record["measured_step_ms"] - 1
    return record


def markdown(records: list[dict]) -> str:
    lines = ["| configuration | parameters | peak measured | peak predicted | error | "
             "step measured | step predicted | error | MFU measured |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        peak = "n/a" if r["measured_peak_gib"] is None else f"{r['measured_peak_gib']:.1f} GiB"
        err = f"{r['peak_error']:+.1%}" if "peak_error" in r else "n/a"
        mfu = f"{r['measured_mfu']:.1%}" if "measured_mfu" in r else "n/a"
        lines.append(f"| {r['config']} | {r['parameters'] / 1e9:.2f} B | {peak} | "
                     f"{r['predicted_peak_gib']:.1f} GiB | {err} | "
                     f"{r['measured_step_ms']:.1f} ms | {r['predicted_step_ms']:.1f} ms | "
                     f"{r['step_error']:+.1%} | {mfu} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for plan_check.jsonl and .md")
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    p.add_argument("--vocab-size", type=int, default=10000)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=280.0,
                   help="start a configuration only if it should end within this many "
                   "seconds of the start (default 280: eager ones need 15 s, compiled 90 s)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = p.parse_args()
    configs = [parse_config(s) for s in args.configs]
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("plan_check.py: no CUDA GPU (--device cpu runs the plumbing only)")
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    start = time.perf_counter()
    for cfg in configs:
        need = NEEDS["compiled" if cfg["compiled"] else "eager"]
        if time.perf_counter() - start + need > args.budget_s:
            print(f"skipped {cfg['spec']}: it would end past --budget-s {args.budget_s:g}",
                  file=sys.stderr)
            continue
        try:
            records.append(measure(cfg, args, device))
        except torch.OutOfMemoryError:
            records.append({"config": cfg["spec"], "error": "out of memory"})
            print(f"{cfg['spec']}: out of memory", file=sys.stderr)
        finally:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if cfg["compiled"]:
                torch._dynamo.reset()
        print(json.dumps(records[-1]), flush=True)
        atomic_write_text(out / "plan_check.jsonl",
                          "".join(json.dumps(r) + "\n" for r in records))
    ok = [r for r in records if "error" not in r]
    atomic_write_text(out / "plan_check.md", markdown(ok))
    print(markdown(ok))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
