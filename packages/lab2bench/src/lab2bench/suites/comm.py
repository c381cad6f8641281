"""``lab2bench comm``: the all-reduce sweep (backend x device x size x world size)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from lab2bench.comm import DEFAULT_SIZES, DEFAULT_WORLD_SIZES, allreduce_sweep, parse_size
from lab2bench.env import env_info
from lab2bench.records import Recorder
from lab2bench.report import markdown_table, plot_sweep
from lab2bench.suites.base import Suite, comma_list, positive_int, write_markdown_report

QUICK_SIZES = (4 * 1024, 64 * 1024, 512 * 1024)
COLUMNS = ["backend", "device", "world_size", "size", "time_ms", "std_ms", "algbw_gbps",
           "busbw_gbps"]
HEADERS = {"world_size": "ranks", "time_ms": "time ms", "std_ms": "std ms",
           "algbw_gbps": "algbw GB/s", "busbw_gbps": "busbw GB/s"}
FLOATFMT = {"time_ms": ".3f", "std_ms": ".3f", "algbw_gbps": ".3g", "busbw_gbps": ".3g"}


def _lower(text: str) -> str:
    return text.lower()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backends", type=comma_list(_lower), default=None,
                        help="gloo and/or nccl, comma-separated (default gloo, plus nccl when "
                             "CUDA is available)")
    parser.add_argument("--devices", type=comma_list(_lower), default=None,
                        help="cpu and/or cuda, comma-separated (default: --device's type, or "
                             "cpu and cuda when CUDA is available)")
    parser.add_argument("--sizes", type=comma_list(parse_size), default=None,
                        help="tensor sizes, e.g. 512KB,1MB,1GB (default 512KB..1GB)")
    parser.add_argument("--world-sizes", type=comma_list(positive_int), default=None,
                        help="numbers of ranks (default 2,4,6)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls per size")
    parser.add_argument("--repeats", type=positive_int, default=None, help="timed calls per size")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds one (backend, device, world size) cell may take")


def run(args: argparse.Namespace) -> int:
    import torch

    cuda = torch.cuda.is_available()
    if args.devices:
        devices = args.devices
    elif args.device:
        devices = [torch.device(args.device).type]
    elif args.quick:
        devices = ["cpu"]
    else:
        devices = ["cpu", "cuda"] if cuda else ["cpu"]
    if args.backends:
        backends = args.backends
    elif args.quick:
        backends = ["gloo"]
    else:
        backends = ["gloo", "nccl"] if cuda else ["gloo"]
    sizes = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    world_sizes = args.world_sizes or ((2,) if args.quick else DEFAULT_WORLD_SIZES)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 5)
    repeats = args.repeats or (5 if args.quick else 20)
    rows = allreduce_sweep(backends=backends, devices=devices, sizes_bytes=sizes,
                           world_sizes=world_sizes, warmup=warmup, repeats=repeats,
                           timeout=args.timeout, on_error="record")
    ok = [r for r in rows if r["status"] == "ok"]
    notes = [f"{r['backend']}/{r['device']} x{r['world_size']}: {r['status']}: {r['note']}"
             for r in rows if r["status"] != "ok"]
    preamble = [f"all_reduce (sum) of float32; time = median over {repeats} calls of the "
                f"slowest rank, after {warmup} warm-up; busbw = algbw · 2(n-1)/n."]
    print(preamble[0])
    print()
    print(markdown_table(ok, COLUMNS, FLOATFMT, headers=HEADERS) if ok else "(no measurements)")
    for note in notes:
        print(f"note: {note}")
    if args.out:
        out = Path(args.out)
        recorder = Recorder(out / "comm.jsonl", env=env_info("cpu"))
        for r in rows:
            config = {k: r.get(k) for k in ("backend", "device", "world_size", "size_bytes",
                                            "dtype")}
            config.update(warmup=warmup, repeats=repeats)
            metrics: dict[str, Any] = {k: v for k, v in r.items() if k not in config}
            recorder.record("comm", config, metrics)
        write_markdown_report(out, "comm", title="All-reduce sweep", rows=ok, columns=COLUMNS,
                              headers=HEADERS, floatfmt=FLOATFMT, preamble=preamble, notes=notes)
        if ok:
            plot_sweep(ok, x="size_bytes", y="busbw_gbps",
                       series=("backend", "device", "world_size"), logx=True,
                       path=out / "comm_busbw.png", title="all-reduce bus bandwidth",
                       xlabel="tensor size (bytes)", ylabel="bus bandwidth (GB/s)")
        print(f"wrote {out / 'comm.jsonl'}, {out / 'comm.md'} and plots", file=sys.stderr)
    return 1 if any(r["status"] == "failed" for r in rows) else 0


SUITE = Suite(
    name="comm",
    help="all-reduce sweep: backend x device x size x world size, time and bus bandwidth",
    add_arguments=add_arguments,
    run=run,
)
