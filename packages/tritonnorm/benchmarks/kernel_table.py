"""RMSNorm implementations side by side: time, bandwidth and share of the copy bandwidth,
forward and forward+backward, each cell checked against float64; ``--fused-add`` does the
same for ``fused_add_rms_norm``; ``--crossover`` times ``tritonnorm.rms_norm`` with its eager
path forced (the Triton kernels, ``F.rms_norm``), per variant (plain, Gemma's offset, no
weight), without the L2 flush: where the eager call is host-bound, which path wins.

    python packages/tritonnorm/benchmarks/kernel_table.py --out DIR          # the full table
    python packages/tritonnorm/benchmarks/kernel_table.py --crossover --out DIR
    python packages/tritonnorm/benchmarks/kernel_table.py --timing both \
        --impl tritonnorm,F.rms_norm,liger,compile-naive
    python packages/tritonnorm/benchmarks/kernel_table.py --fused-add
    python packages/tritonnorm/benchmarks/kernel_table.py --quick           # CPU smoke run

Achieved bandwidth = minimum bytes / median time, the minimum being what any
implementation must move: the forward reads x and writes y (2·N·H elements), the backward
reads x and dy and writes dx (3·N·H more, 5·N·H for forward+backward). Fused add: the
forward reads x and r and writes y and the sum; the backward reads dy, dsum and the sum
and writes dx. Shares are of the device's copy bandwidth (read + write), measured in the
same run. Timing ``eager`` (``lab2bench.timing.measure``): CUDA events around calls queued
back to back, host overhead included where it exceeds the device time; ``graph``
(``graph_time``): replays of a CUDA graph of one call, device time only. ``×best alt`` is
the fastest alternative's time / tritonnorm's (>1: tritonnorm faster).

Writes ``DIR/norm.jsonl`` (one record per row), ``DIR/norm.md`` and PNG plots with ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import impls
import torch

from lab2bench.bandwidth import copy_bandwidth
from lab2bench.env import env_info
from lab2bench.records import Recorder, atomic_write_text
from lab2bench.report import markdown_table, plot_sweep, progress
from lab2bench.timing import graph_time, measure
from tritonnorm import _host, fused_add_rms_norm

ROWS, HIDDEN = 50_000, (1024, 2048, 4096, 8192)
#: The long rows, where the alternatives fall behind.
LARGE_ROWS, LARGE_HIDDEN, LARGE_DTYPE = 4096, (65_536, 131_072), "bfloat16"
QUICK_ROWS, QUICK_HIDDEN = 64, (128, 512)
FUSED_ADD_DTYPES, FUSED_ADD_HIDDEN = ("bfloat16", "float32"), (1024, 4096)
FUSED_ADD_BASELINE = "compile(add+nn.RMSNorm)"
#: ``--crossover``'s cells.
CROSSOVER_DTYPES, CROSSOVER_HIDDEN = ("bfloat16", "float32"), (512, 1024, 2048, 4096, 8192)
CROSSOVER_ROWS = (8 * 512, 32 * 512, 50_000)
#: Error tolerated (norm-relative, against float64) before a row is flagged.
TOLERANCE = {"float32": 1e-5, "bfloat16": 1.6e-2, "float16": 2e-3}
CHECK_ROWS = 1024  # rows compared with float64 (the op is row-wise)
HEADERS = {"fwd_ms": "fwd ms", "fwd_gbps": "fwd GB/s", "fwd_pct": "fwd %",
           "fwdbwd_ms": "fwd+bwd ms", "fwdbwd_gbps": "fwd+bwd GB/s", "fwdbwd_pct": "fwd+bwd %",
           "fwd_vs_best": "fwd ×best alt", "fwdbwd_vs_best": "fwd+bwd ×best alt",
           "rel_err": "rel err", "bwd_ms": "bwd ms", "bwd_pct": "bwd %"}
FLOATFMT = {k: ".3f" if k.endswith("_ms") else ".2f" if "_vs_" in k else ".1e"
            if k == "rel_err" else ".0f" for k in HEADERS}


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    y, ref = y.detach().double(), ref.detach()
    return float((y - ref).norm() / ref.norm().clamp_min(1e-300))


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, is_rms: bool) -> torch.Tensor:
    x, w, b = x.double(), w.double(), b.double()
    if is_rms:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    return torch.nn.functional.layer_norm(x, x.shape[-1:], w, b, 1e-5)


def timed_rows(name: str, timings: list[str], args: argparse.Namespace, device: torch.device,
               err: float | None, **phases) -> list[dict]:
    """One row per timing: the median ms of each phase (``phases``: name -> (fn, whether
    the backward of fn's output is timed too)), or a ``note`` where timing failed."""
    kw = dict(warmup=args.warmup, repeats=args.repeats, device=device,
              flush_l2=device.type == "cuda" and not args.crossover)
    rows = []
    for timing in timings:
        timer = graph_time if timing == "graph" else measure
        try:
            rows.append({"impl": name, "timing": timing, "rel_err": err} | {
                f"{phase}_ms": timer(fn, backward=backward, **kw).median * 1e3
                for phase, (fn, backward) in phases.items()})
        except Exception as e:  # a graph capture an implementation does not support
            rows.append({"impl": name, "timing": timing, "note": impls.short(e)})
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    return rows


def norm_cell(name: str, x, w, b, timings: list[str], args) -> list[dict]:
    """One implementation on one input: its error against float64, then per timing its
    forward and forward+backward times; a row with ``note`` where it could not run."""
    try:
        fn = impls.ALL[name](w, b)
        with torch.no_grad():
            y = fn(x[:CHECK_ROWS], w, b)
    except Exception as err:  # Unavailable, or an implementation's limit (Liger's H)
        note = str(err) if isinstance(err, impls.Unavailable) else impls.short(err)
        return [{"impl": name, "timing": "/".join(timings), "note": note}]
    mode, offset, has_w = impls.VARIANTS.get(name.partition("/")[2], ("none", 0.0, True))
    gain = w.double() + offset if has_w else torch.ones_like(w, dtype=torch.float64)
    err = rel_err(y, reference(x[:CHECK_ROWS], gain, b, name != "F.layer_norm"))
    xg = x.detach().requires_grad_(True)
    leaves = [xg, w.requires_grad_(True), b.requires_grad_(True)]

    def forward():
        with torch.no_grad():
            return fn(x, w, b)

    def forward_backward():
        for t in leaves:  # fresh gradients: accumulating would add a read-modify-write of dx
            t.grad = None
        return fn(xg, w, b)

    rows = timed_rows(name, timings, args, x.device, err, fwd=(forward, False),
                      fwdbwd=(forward_backward, True))
    for t in (w, b):
        t.requires_grad_(False)
        t.grad = None
    return rows


def fused_add_cell(name: str, x, r, w, dy, ds, timings: list[str], args) -> list[dict]:
    """``fused_add_rms_norm`` (or torch.compile of x + r then ``nn.RMSNorm``): forward and
    forward+backward through autograd; tritonnorm's rows carry their error against float64."""
    w.requires_grad_(True)
    if name == "tritonnorm":
        fn = lambda x, r: fused_add_rms_norm(x, r, w, 1e-5)  # noqa: E731
        xr, rr, wr = (t.detach().double().requires_grad_() for t in (x, r, w))
        xa, ra = (t.detach().clone().requires_grad_() for t in (x, r))
        y, s = fn(xa, ra)
        torch.autograd.backward((y, s), (dy, ds))
        sr = xr + rr
        yr = reference(sr, wr, wr, True)
        torch.autograd.backward((yr, sr), (dy.double(), ds.double()))
        err = max(rel_err(a, e) for a, e in ((y, yr), (s, sr), (xa.grad, xr.grad),
                                             (ra.grad, rr.grad), (w.grad, wr.grad)))
    else:
        def add_norm(x, r):  # what nn.RMSNorm's forward calls
            s = x + r
            return torch.nn.functional.rms_norm(s, s.shape[-1:], w, 1e-5), s

        fn, err = torch.compile(add_norm), None
    xg, rg = (t.detach().requires_grad_() for t in (x, r))

    def forward():
        with torch.no_grad():
            return fn(x, r)

    def forward_backward():
        for t in (xg, rg, w):
            t.grad = None
        torch.autograd.backward(fn(xg, rg), (dy, ds))

    rows = timed_rows(name, timings, args, x.device, err, fwd=(forward, False),
                      fwdbwd=(forward_backward, False))
    w.requires_grad_(False)
    w.grad = None
    return rows


def kernels_row(x, r, w, dy, ds, timings: list[str], args, fwd_bytes: int, bwd_bytes: int,
                bw: float) -> dict:
    """The fused add's forward and backward kernels, each timed alone (the last timing)."""
    w = w.detach()
    _, s, rstd = _host.fused_add_rms_norm_fwd(x, r, w, 1e-5)
    row = timed_rows("tritonnorm kernels", timings[-1:], args, x.device, None,
                     fwd=(lambda: _host.fused_add_rms_norm_fwd(x, r, w, 1e-5), False),
                     bwd=(lambda: _host.fused_add_rms_norm_bwd(dy, ds, s, w, rstd, r.dtype),
                          False))[0]
    if "note" not in row:
        for key, nbytes in (("fwd", fwd_bytes), ("bwd", bwd_bytes)):
            row[f"{key}_pct"] = 100 * nbytes / (row[f"{key}_ms"] / 1e3) / bw
    return row


def add_bandwidth(row: dict, fwd_bytes: int, fwdbwd_bytes: int, bw: float) -> None:
    for key, nbytes in (("fwd", fwd_bytes), ("fwdbwd", fwdbwd_bytes)):
        if f"{key}_ms" in row:
            row[f"{key}_gbps"] = nbytes / row[f"{key}_ms"] / 1e6
            row[f"{key}_pct"] = 100 * nbytes / (row[f"{key}_ms"] / 1e3) / bw


def add_ratios(cell: list[dict]) -> None:
    """``*_vs_best`` on tritonnorm's rows: the fastest alternative's time / this time."""
    for key in ("fwd_ms", "fwdbwd_ms"):
        alts = [r[key] for r in cell if r["impl"] not in impls.OURS and key in r]
        for r in cell:
            if alts and r["impl"] in impls.OURS and key in r:
                r[key.replace("_ms", "_vs_best")] = min(alts) / r[key]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", type=impls.parse_impls, help="comma-separated: "
                   f"{', '.join(impls.ALL)} (default: all but tritonnorm.rms_norm; "
                   "--quick: also not compile-naive)")
    p.add_argument("--dtype", type=impls.parse_dtypes, help="default float32,bfloat16,float16")
    p.add_argument("--hidden", type=impls.parse_ints, help="hidden sizes H (default "
                   f"{','.join(map(str, HIDDEN))} and the long rows)")
    p.add_argument("--rows", type=impls.parse_ints, help=f"numbers of rows (default {ROWS})")
    p.add_argument("--no-large", action="store_true", help=f"leave out the long rows "
                   f"({LARGE_ROWS} x {LARGE_HIDDEN}, {LARGE_DTYPE})")
    p.add_argument("--timing", choices=("eager", "graph", "both"),
                   help="default both on CUDA, eager on the CPU")
    p.add_argument("--fused-add", action="store_true",
                   help=f"fused_add_rms_norm instead ({FUSED_ADD_DTYPES} x H {FUSED_ADD_HIDDEN})")
    p.add_argument("--crossover", action="store_true", help="the eager paths of rms_norm forced, "
                   f"per variant ({CROSSOVER_DTYPES} x H {CROSSOVER_HIDDEN} x {CROSSOVER_ROWS})")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls")
    p.add_argument("--repeats", type=int, default=30, help="timed calls; the median is shown")
    p.add_argument("--quick", action="store_true", help="tiny shapes on the CPU: a smoke run")
    p.add_argument("--device", help="default cuda where available (--quick: cpu)")
    p.add_argument("--out", type=Path, help="folder for norm.jsonl, norm.md and the plots")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.quick
                                          else "cpu"))
    if args.quick:
        args.warmup, args.repeats = min(args.warmup, 1), min(args.repeats, 3)
    timing = args.timing or ("both" if device.type == "cuda" else "eager")
    if timing != "eager" and device.type != "cuda":
        p.error("--timing graph/both needs a CUDA device")
    timings = ["eager", "graph"] if timing == "both" else [timing]
    names = args.impl or (list(impls.CROSSOVER) if args.crossover else [
        n for n in impls.IMPLS if n != "tritonnorm.rms_norm"
        and not (args.quick and n in impls.SLOW_SETUP)])
    rows_set = args.rows or ([QUICK_ROWS] if args.quick else CROSSOVER_ROWS if args.crossover
                             else [ROWS])
    hidden = args.hidden or (QUICK_HIDDEN if args.quick else FUSED_ADD_HIDDEN if args.fused_add
                             else CROSSOVER_HIDDEN if args.crossover else HIDDEN)
    dtypes = args.dtype or (["float32"] if args.quick else list(
        FUSED_ADD_DTYPES if args.fused_add else CROSSOVER_DTYPES if args.crossover
        else impls.DTYPES))
    cells = [(d, h, n) for d in dtypes for h in hidden for n in rows_set]
    if not (args.quick or args.fused_add or args.crossover or args.hidden or args.rows
            or args.no_large) and LARGE_DTYPE in dtypes:
        cells += [(LARGE_DTYPE, h, LARGE_ROWS) for h in LARGE_HIDDEN]
    if args.fused_add:
        names = ["tritonnorm"] + ([] if args.quick else [FUSED_ADD_BASELINE])

    bw = copy_bandwidth(device, (8 << 20) if args.quick else None, repeats=5 if args.quick
                        else 20)
    env = env_info(device)
    recorder = Recorder(args.out / "norm.jsonl", env=env) if args.out else None
    if recorder:
        recorder.record("norm", {"impl": "copy", "device": str(device)},
                        {"status": "ok", "copy_gbps": bw / 1e9})
    gen = torch.Generator(device=device).manual_seed(args.seed)
    table, kernels, notes, fails = [], [], [], 0
    for dtype_name, h, n in progress(cells, description="norm"):
        # Drawn on the device, random weights (never ones: they would hide weight bugs).
        randn = lambda *shape: torch.randn(*shape, generator=gen, device=device)  # noqa: E731
        dtype, size = impls.DTYPES[dtype_name], n * h * impls.DTYPES[dtype_name].itemsize
        x = randn(n, h).to(dtype)
        w = (0.5 + torch.rand(h, generator=gen, device=device)).to(dtype)
        if args.fused_add:
            r, dy, ds = (randn(n, h).to(dtype) for _ in range(3))
            fwd_bytes, bwd_bytes = 4 * size, 4 * size
            cell = [row for name in names for row in fused_add_cell(
                name, x, r, w, dy, ds, timings, args)]
            if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
                kernels.append({"dtype": dtype_name, "H": h, "rows": n, **kernels_row(
                    x, r, w, dy, ds, timings, args, fwd_bytes, bwd_bytes, bw)})
        else:
            b = (0.1 * randn(h)).to(dtype)
            fwd_bytes, bwd_bytes = 2 * size, 3 * size
            cell = [row for name in names for row in norm_cell(name, x, w, b, timings, args)]
        for t in timings:
            add_ratios([r for r in cell if r["timing"] == t])
        for row in cell:
            row.update(dtype=dtype_name, H=h, rows=n)
            add_bandwidth(row, fwd_bytes, fwd_bytes + bwd_bytes, bw)
            if "note" in row:
                notes.append(f"{row['impl']} ({row['timing']}) at {dtype_name} H={h} rows={n}: "
                             f"{row['note']}")
            elif row.get("rel_err") is not None and row["rel_err"] > TOLERANCE[dtype_name] * (
                    10 if row["impl"] == "F.layer_norm" else 1):
                notes.append(f"{row['impl']} at {dtype_name} H={h}: error {row['rel_err']:.1e}")
                fails += row["impl"] in impls.OURS
            if recorder:
                recorder.record("norm", {k: row[k] for k in ("dtype", "H", "rows", "impl",
                                                             "timing")} | {"device": str(device)},
                                {"status": "skipped" if "note" in row else "ok", "copy_gbps":
                                 bw / 1e9, **row})
        table += [r for r in cell if "note" not in r]
        del x, w
        if device.type == "cuda":
            torch.cuda.empty_cache()

    columns = ["dtype", "H", "rows", "impl", "timing", "fwd_ms", "fwd_gbps", "fwd_pct",
               "fwdbwd_ms", "fwdbwd_gbps", "fwdbwd_pct", "fwd_vs_best", "fwdbwd_vs_best",
               "rel_err"]
    what = "fused_add_rms_norm (y, x + r)" if args.fused_add else "RMSNorm implementations"
    md = [f"# {what}", "", f"{env['device_name']} ({device}), copy bandwidth {bw / 1e9:.0f} "
          f"GB/s; median of {args.repeats} calls after {args.warmup} warm-up.", "",
          markdown_table(table, columns, FLOATFMT, headers=HEADERS) if table else "(none)"]
    if kernels:
        md += ["Kernels alone:", "", markdown_table(
            kernels, ["dtype", "H", "rows", "timing", "fwd_ms", "fwd_pct", "bwd_ms", "bwd_pct"],
            FLOATFMT, headers=HEADERS)]
    md += [f"- {note}" for note in notes]
    print("\n".join(md))
    if args.out:
        atomic_write_text(args.out / "norm.md", "\n".join(md) + "\n")
        for (dtype_name, t), key in ((k, key) for k in dict.fromkeys(
                (r["dtype"], r["timing"]) for r in table) for key in ("fwd", "fwdbwd")):
            plot_sweep([r for r in table if (r["dtype"], r["timing"]) == (dtype_name, t)],
                       x="H", y=f"{key}_pct", series="impl", logx=True,
                       path=args.out / f"norm_{key}_{dtype_name}_{t}.png",
                       title=f"{what}, {key}, {dtype_name}, {t} timing",
                       ylabel="% of copy bandwidth")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
