"""The ``lab2bench`` command: ``lab2bench comm``, the all-reduce sweep (backend x device x
size x world size), printed as a Markdown table; with ``--out DIR`` also ``comm.jsonl``,
``comm.md`` and a bus-bandwidth plot. ``--help`` imports no torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lab2bench import __version__
from lab2bench.comm import DEFAULT_SIZES, DEFAULT_WORLD_SIZES, parse_size

QUICK_SIZES = (4 * 1024, 64 * 1024, 512 * 1024)
COLUMNS = ["backend", "device", "world_size", "size", "time_ms", "std_ms", "algbw_gbps",
           "busbw_gbps"]
HEADERS = {"world_size": "ranks", "time_ms": "time ms", "std_ms": "std ms",
           "algbw_gbps": "algbw GB/s", "busbw_gbps": "busbw GB/s"}
FLOATFMT = {"time_ms": ".3f", "std_ms": ".3f", "algbw_gbps": ".3g", "busbw_gbps": ".3g"}


def comma_list(convert: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """An argparse ``type`` for comma-separated values."""

    def parse(text: str) -> list[Any]:
        try:
            items = [convert(t.strip()) for t in text.split(",") if t.strip()]
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        if not items:
            raise argparse.ArgumentTypeError(f"empty list: {text!r}")
        return items

    return parse


def positive_int(text: str) -> int:
    if int(text) < 1:
        raise ValueError(f"expected a positive integer, got {text}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lab2bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    what = "all-reduce sweep: backend x device x size x world size, time and bus bandwidth"
    p = sub.add_parser("comm", help=what, description=what)
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes, Gloo on the CPU, 2 ranks: done in seconds")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="write comm.jsonl (appended), comm.md and a plot here")
    p.add_argument("--device", default=None, help="cpu or cuda (default: both where CUDA is)")
    p.add_argument("--backends", type=comma_list(str.lower), default=None,
                   help="gloo and/or nccl (default gloo, plus nccl when CUDA is available)")
    p.add_argument("--devices", type=comma_list(str.lower), default=None,
                   help="cpu and/or cuda (default: --device's type, or cpu and cuda when CUDA "
                        "is available)")
    p.add_argument("--sizes", type=comma_list(parse_size), default=None,
                   help="tensor sizes, e.g. 512KB,1MB,1GB (default 512KB..1GB)")
    p.add_argument("--world-sizes", type=comma_list(positive_int), default=None,
                   help="numbers of ranks (default 2,4,6)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls per size")
    p.add_argument("--repeats", type=positive_int, default=None, help="timed calls per size")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds one (backend, device, world size) cell may take")
    return parser


def comm(args: argparse.Namespace) -> int:
    """Run the sweep the options describe; 1 if a cell failed."""
    import torch

    from lab2bench.comm import allreduce_sweep
    from lab2bench.env import env_info
    from lab2bench.records import Recorder, atomic_write_text
    from lab2bench.report import markdown_table, plot_sweep

    cuda = torch.cuda.is_available()
    if args.devices or args.device:
        devices = args.devices or [torch.device(args.device).type]
    else:
        devices = ["cpu", "cuda"] if cuda and not args.quick else ["cpu"]
    backends = args.backends or (["gloo", "nccl"] if cuda and not args.quick else ["gloo"])
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
    text = "\n".join([
        f"all_reduce (sum) of float32; time = median over {repeats} calls of the slowest "
        f"rank, after {warmup} warm-up; busbw = algbw · 2(n-1)/n.", "",
        markdown_table(ok, COLUMNS, FLOATFMT, headers=HEADERS) if ok else "(no measurements)",
        *(f"note: {note}" for note in notes)])
    print(text)
    if args.out:
        out = Path(args.out)
        recorder = Recorder(out / "comm.jsonl", env=env_info("cpu"))
        for r in rows:
            config = {k: r.get(k) for k in ("backend", "device", "world_size", "size_bytes",
                                            "dtype")}
            config.update(warmup=warmup, repeats=repeats)
            recorder.record("comm", config, {k: v for k, v in r.items() if k not in config})
        atomic_write_text(out / "comm.md", f"# All-reduce sweep\n\n{text}\n")
        if ok:
            plot_sweep(ok, x="size_bytes", y="busbw_gbps",
                       series=("backend", "device", "world_size"), logx=True,
                       path=out / "comm_busbw.png", title="all-reduce bus bandwidth",
                       xlabel="tensor size (bytes)", ylabel="bus bandwidth (GB/s)")
        print(f"wrote {out / 'comm.jsonl'}, {out / 'comm.md'} and plots", file=sys.stderr)
    return 1 if any(r["status"] == "failed" for r in rows) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit code (also the console script)."""
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return comm(args)
    except (ValueError, RuntimeError) as err:
        print(f"lab2bench {args.command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
