"""``lab2bench norm``: RMSNorm implementations side by side, forward and forward+backward.

Achieved bandwidth = minimum bytes / time, where the minimum is what any
implementation must move: the forward reads x and writes y (2·N·H elements), the
backward reads x and grad_output and writes dx (3·N·H more, so 5·N·H for
forward+backward); the weight is negligible. It is reported as a share of the
device's copy bandwidth (read + write), measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lab2bench.env import env_info
from lab2bench.records import Recorder
from lab2bench.report import plot_sweep, progress
from lab2bench.suites.base import Suite, comma_list, positive_int, show_report
from tritonnorm.bench.norm_impls import (
    IMPLS,
    OURS,
    Unavailable,
    default_impls,
    rms_norm_reference,
)

if TYPE_CHECKING:  # torch is imported by the functions that run, so that --help skips it
    import torch

#: Names of torch dtypes.
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
#: The handout's shapes, and the large-H set where the alternatives fall behind.
DEFAULT_ROWS = 50_000
DEFAULT_HIDDEN = (1024, 2048, 4096, 8192)
LARGE_ROWS = 4096
LARGE_HIDDEN = (65_536, 131_072)
LARGE_DTYPE = "bfloat16"
QUICK_ROWS = 64
QUICK_HIDDEN = (128, 512)
#: Forward-output error tolerated before a row is flagged (norm-relative, vs float64).
TOLERANCE = {"float32": 1e-5, "bfloat16": 1.6e-2, "float16": 2e-3}
CHECK_ROWS = 1024  # rows compared to the float64 reference (the op is row-wise)
#: ``--timing`` choices; "both" measures eager and graph, one row each.
TIMINGS = ("eager", "graph", "both")

COLUMNS = ["dtype", "H", "rows", "impl", "timing", "fwd_ms", "fwd_gbps", "fwd_pct", "fwdbwd_ms",
           "fwdbwd_gbps", "fwdbwd_pct", "fwd_vs_best", "fwdbwd_vs_best", "rel_err"]
HEADERS = {"fwd_ms": "fwd ms", "fwd_gbps": "fwd GB/s", "fwd_pct": "fwd %",
           "fwdbwd_ms": "fwd+bwd ms", "fwdbwd_gbps": "fwd+bwd GB/s", "fwdbwd_pct": "fwd+bwd %",
           "fwd_vs_best": "fwd ×best alt", "fwdbwd_vs_best": "fwd+bwd ×best alt",
           "rel_err": "rel err"}
FLOATFMT = {"fwd_ms": ".3f", "fwd_gbps": ".0f", "fwd_pct": ".0f", "fwdbwd_ms": ".3f",
            "fwdbwd_gbps": ".0f", "fwdbwd_pct": ".0f", "fwd_vs_best": ".2f",
            "fwdbwd_vs_best": ".2f", "rel_err": ".1e"}


def _dtype_name(text: str) -> str:
    name = DTYPE_ALIASES.get(text.lower(), text.lower())
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {text!r}; use {', '.join(DTYPES)}")
    return name


def _impl_name(text: str) -> str:
    aliases = {"compile": "compile-naive", "compile(naive)": "compile-naive",
               "naive": "torch-naive", "rms_norm": "F.rms_norm", "layer_norm": "F.layer_norm",
               "layernorm": "F.layer_norm", "triton": "tritonnorm"}
    name = aliases.get(text, text)
    if name not in IMPLS:
        raise ValueError(f"unknown impl {text!r}; use {', '.join(IMPLS)}")
    return name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--impl", type=comma_list(_impl_name), default=None,
                        help=f"implementations, comma-separated (default all): {', '.join(IMPLS)}")
    parser.add_argument("--dtype", type=comma_list(_dtype_name), default=None,
                        help="dtypes, comma-separated (default float32,bfloat16,float16)")
    parser.add_argument("--hidden", type=comma_list(positive_int), default=None,
                        help="hidden sizes H (default 1024,2048,4096,8192 plus the large-H set)")
    parser.add_argument("--rows", type=comma_list(positive_int), default=None,
                        help=f"numbers of rows (default {DEFAULT_ROWS})")
    parser.add_argument("--no-large", action="store_true",
                        help=f"leave out the large-H set ({LARGE_ROWS} rows x "
                             f"{', '.join(map(str, LARGE_HIDDEN))}, {LARGE_DTYPE})")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls (default 5)")
    parser.add_argument("--repeats", type=positive_int, default=None,
                        help="timed calls; the median is reported (default 30)")
    parser.add_argument("--flush-l2", action=argparse.BooleanOptionalAction, default=None,
                        help="flush the L2 cache before each timed call (default: on CUDA)")
    parser.add_argument("--timing", choices=TIMINGS, default=None,
                        help="eager: CUDA events around Python calls queued back to back "
                             "(host overhead shows where it exceeds the device time); graph: "
                             "replays of a CUDA graph of one call (device time only); both "
                             "(default on CUDA; eager on the CPU)")


def _configs(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(dtype, H, rows) cells to measure."""
    if args.quick:
        dtypes = args.dtype or ["float32"]
        return [(d, h, r) for d in dtypes for h in (args.hidden or QUICK_HIDDEN)
                for r in (args.rows or [QUICK_ROWS])]
    dtypes = args.dtype or list(DTYPES)
    cells = [(d, h, r) for d in dtypes for h in (args.hidden or DEFAULT_HIDDEN)
             for r in (args.rows or [DEFAULT_ROWS])]
    if args.hidden is None and args.rows is None and not args.no_large and LARGE_DTYPE in dtypes:
        cells += [(LARGE_DTYPE, h, LARGE_ROWS) for h in LARGE_HIDDEN]
    return cells


def _impls(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """Implementations to run, and notes about those left out."""
    if args.impl:
        return list(dict.fromkeys(args.impl)), []
    return default_impls(args.quick, norm_suite_only=True)


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm().clamp_min(1e-300))


def _measure_impl(name: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                  device: torch.device, warmup: int, repeats: int,
                  flush_l2: bool, timings: list[str]) -> dict[str, Any]:
    """Check one implementation against float64, then time fwd and fwd+bwd each way."""
    import torch

    from lab2bench.timing import measure

    impl = IMPLS[name]
    try:
        fn = impl.make(w, b)
        with torch.no_grad():
            y = fn(x[:CHECK_ROWS])
    except Unavailable as err:
        return {"status": "skipped", "note": str(err)}
    except Exception as err:  # e.g. Liger refusing H > 65,536: a limit of that impl
        return {"status": "skipped", "note": f"raised {type(err).__name__}: {_short(err)}"}
    xs = x[:CHECK_ROWS]
    if impl.is_rms:
        ref = rms_norm_reference(xs, w)
    else:
        ref = torch.nn.functional.layer_norm(xs.double(), (w.shape[0],), w.double(), b.double(),
                                             1e-5)
    out: dict[str, Any] = {"status": "ok", "note": "", "rel_err": _rel_err(y, ref)}
    del y, ref

    xg = x.detach().requires_grad_(True)
    params = [p.requires_grad_(True) for p in (w, b)]

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return fn(x)

    def forward_backward_step() -> torch.Tensor:
        # Fresh gradients each call: accumulating into old ones would add a
        # read-modify-write of dx to every timed call.
        xg.grad = None
        for p in params:
            p.grad = None
        return fn(xg)

    out["timings"] = {}
    try:
        for timing in timings:
            graph = timing == "graph"
            try:
                fwd = measure(forward, warmup=warmup, repeats=repeats, device=device,
                              flush_l2=flush_l2, cuda_graph=graph)
                fwdbwd = measure(forward_backward_step, warmup=warmup, repeats=repeats,
                                 device=device, flush_l2=flush_l2, backward=True,
                                 cuda_graph=graph)
            except Exception as err:
                what = "could not be captured in a CUDA graph" if graph else "failed"
                out["timings"][timing] = {
                    "status": "skipped" if graph else "failed",
                    "note": f"{what}: raised {type(err).__name__}: {_short(err)}"}
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                continue
            out["timings"][timing] = {"status": "ok", "note": "", "fwd": fwd, "fwdbwd": fwdbwd}
    finally:
        xg.grad = None
        for p in (w, b):
            p.requires_grad_(False)
            p.grad = None
    return out


def _short(err: BaseException, limit: int = 300) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run(args: argparse.Namespace) -> int:
    import torch

    from lab2bench.bandwidth import copy_bandwidth_stats
    from lab2bench.devices import resolve_device

    device = resolve_device(args.device or ("cpu" if args.quick else None))
    flush_l2 = args.flush_l2 if args.flush_l2 is not None else device.type == "cuda"
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 5)
    repeats = args.repeats or (3 if args.quick else 30)
    timing = args.timing or ("both" if device.type == "cuda" else "eager")
    if timing != "eager" and device.type != "cuda":
        raise SystemExit("lab2bench norm: --timing graph/both needs a CUDA device")
    timings = ["eager", "graph"] if timing == "both" else [timing]
    if warmup < 0:
        raise SystemExit("lab2bench norm: --warmup must be >= 0")
    configs = _configs(args)
    impl_names, notes = _impls(args)
    if device.type == "cpu" and not args.quick:
        print("lab2bench norm: full shapes on the CPU take long; --quick is the CPU form",
              file=sys.stderr)

    copy_bytes = (8 << 20) if args.quick else None
    copy_bps, copy_stats = copy_bandwidth_stats(device, copy_bytes,
                                                repeats=5 if args.quick else 20)
    recorder = Recorder(Path(args.out) / "norm.jsonl", env=env_info(device)) if args.out else None
    if recorder is not None:
        recorder.record("norm", {"impl": "copy", "device": str(device),
                                 "nbytes": copy_bytes or "default"},
                        {"status": "ok", "copy_gbps": copy_bps / 1e9,
                         **copy_stats.to_dict(unit="ms")})

    rows: list[dict[str, Any]] = []
    # Drawn on the device: a 50,000 x 8,192 input would take seconds to draw on the CPU.
    gen = torch.Generator(device=device).manual_seed(args.seed)
    for dtype_name, hidden, nrows in progress(configs, description="norm"):
        dtype = getattr(torch, dtype_name)
        # Random inputs and weights (never ones: a weight of ones hides weight bugs).
        x = torch.randn(nrows, hidden, generator=gen, device=device).to(dtype)
        w = (0.5 + torch.rand(hidden, generator=gen, device=device)).to(dtype)
        b = (0.1 * torch.randn(hidden, generator=gen, device=device)).to(dtype)
        itemsize = x.element_size()
        fwd_bytes = 2 * nrows * hidden * itemsize
        fwdbwd_bytes = 5 * nrows * hidden * itemsize
        cell_rows = []
        for name in impl_names:
            result = _measure_impl(name, x, w, b, device, warmup, repeats, flush_l2, timings)
            # An impl that could not run at all gets one row, whatever the timings.
            per_timing = result.get("timings") or {"/".join(timings): result}
            for timing_name, timed in per_timing.items():
                row: dict[str, Any] = {"dtype": dtype_name, "H": hidden, "rows": nrows,
                                       "impl": name, "timing": timing_name,
                                       "status": timed["status"], "note": timed["note"]}
                if timed["status"] != "ok":
                    notes.append(f"{name} ({timing_name}) at {dtype_name} H={hidden} "
                                 f"rows={nrows}: {timed['status']}: {timed['note']}")
                else:
                    fwd, fwdbwd = timed["fwd"], timed["fwdbwd"]
                    row.update({
                        "fwd_ms": fwd.median_ms,
                        "fwd_gbps": fwd_bytes / fwd.median / 1e9,
                        "fwd_pct": 100 * fwd_bytes / fwd.median / copy_bps,
                        "fwdbwd_ms": fwdbwd.median_ms,
                        "fwdbwd_gbps": fwdbwd_bytes / fwdbwd.median / 1e9,
                        "fwdbwd_pct": 100 * fwdbwd_bytes / fwdbwd.median / copy_bps,
                        "rel_err": result["rel_err"],
                    })
                cell_rows.append((row, timed))
            if result["status"] == "ok":
                tol = TOLERANCE[dtype_name] * (1 if IMPLS[name].is_rms else 10)
                if result["rel_err"] > tol:
                    notes.append(f"{name} at {dtype_name} H={hidden}: forward error "
                                 f"{result['rel_err']:.2e} exceeds {tol:.0e}")
        for timing_name in timings:
            _add_ratios([r for r, _ in cell_rows if r["timing"] == timing_name])
        for row, result in cell_rows:
            rows.append(row)
            if recorder is not None:
                config = {k: row[k] for k in ("dtype", "H", "rows", "impl", "timing")}
                config.update(device=str(device), warmup=warmup, repeats=repeats,
                              flush_l2=flush_l2, fwd_bytes=fwd_bytes, fwdbwd_bytes=fwdbwd_bytes)
                metrics = {k: v for k, v in row.items() if k not in config}
                metrics["copy_gbps"] = copy_bps / 1e9
                for key in ("fwd", "fwdbwd"):
                    if key in result:
                        metrics[f"{key}_stats"] = result[key].to_dict(unit="ms")
                recorder.record("norm", config, metrics)
        del x, w, b
        if device.type == "cuda":
            torch.cuda.empty_cache()

    ok_rows = [r for r in rows if r["status"] == "ok"]
    preamble = [f"Device: {env_info(device)['device_name']} ({device}); copy bandwidth "
                f"{copy_bps / 1e9:.1f} GB/s (read+write); median of {repeats} calls after "
                f"{warmup} warm-up, L2 flush {'on' if flush_l2 else 'off'}; timing "
                f"{' and '.join(timings)} (eager: Python calls queued back to back, host "
                f"overhead included where it exceeds the device time; graph: CUDA-graph "
                f"replays of one call, device time only).",
                "Minimum bytes: forward 2·N·H elements, forward+backward 5·N·H. "
                "'×best alt' = fastest non-tritonnorm time / this time (>1: tritonnorm faster)."]
    show_report(args.out or None, "norm", title="RMSNorm implementations", rows=ok_rows,
                columns=COLUMNS, headers=HEADERS, floatfmt=FLOATFMT, preamble=preamble,
                notes=notes)
    if args.out:
        out = Path(args.out)
        for dtype_name in dict.fromkeys(r["dtype"] for r in ok_rows):
            for timing_name in timings:
                subset = [r for r in ok_rows
                          if r["dtype"] == dtype_name and r["timing"] == timing_name]
                suffix = "" if timing_name == "eager" else f"_{timing_name}"
                for key, what in (("fwd", "forward"), ("fwdbwd", "forward+backward")):
                    plot_sweep(subset, x="H", y=f"{key}_pct", series="impl", logx=True,
                               path=out / f"norm_{key}_{dtype_name}{suffix}.png",
                               title=f"RMSNorm {what}, {dtype_name}, {timing_name} timing: "
                                     "share of copy bandwidth",
                               ylabel="% of copy bandwidth")
        print(f"wrote {out / 'norm.jsonl'}, {out / 'norm.md'} and plots", file=sys.stderr)
    return 1 if any(r["status"] == "failed" for r in rows) else 0


def _add_ratios(cell: list[dict[str, Any]]) -> None:
    """Fill ``*_vs_best`` on tritonnorm rows: fastest alternative's time / this time."""
    for key in ("fwd", "fwdbwd"):
        alts = [r[f"{key}_ms"] for r in cell
                if r["impl"] not in OURS and r.get(f"{key}_ms") is not None]
        if not alts:
            continue
        best = min(alts)
        for r in cell:
            if r["impl"] in OURS and r.get(f"{key}_ms"):
                r[f"{key}_vs_best"] = best / r[f"{key}_ms"]


def _add_all_arguments(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")


SUITE = Suite(
    name="norm",
    help="RMSNorm implementations side by side: time, bandwidth, share of copy bandwidth",
    add_arguments=_add_all_arguments,
    run=run,
)
