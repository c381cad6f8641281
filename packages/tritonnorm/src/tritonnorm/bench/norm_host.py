"""``lab2bench norm-host``: the host (CPU) cost of one RMSNorm call, forward and backward.

Inside a model a norm's kernels are short, so a step can be limited by the time the host
needs to issue them: Python, autograd's bookkeeping and the launch path. This suite measures
that time per call for every implementation of ``norm_impls`` (plus ``tritonnorm.rms_norm``,
the entry point ``tritonnorm.RMSNorm`` calls) and for a one-op baseline, on inputs small
enough (64 × H by default) that the device never limits.

How, per implementation and round, with ``time.perf_counter`` from a synchronised start to
one device synchronisation after the last call:

- **forward**: a chain of N calls, each on the previous call's output and with a weight leaf
  of its own (as every norm of a model has its own weight), with autograd recording (the
  input and the weights require grad), so whatever the implementation saves for backward is
  counted. The outputs stay alive (the graph holds them): freeing them belongs to the
  backward, as in training. Figure: time / N.
- **backward**: one ``backward(g)`` of that chain. The engine runs the N backward nodes and
  the N ``AccumulateGrad`` of the weights (into ``.grad`` set to None beforehand, as after
  ``zero_grad(set_to_none=True)``), freeing the saved tensors as it goes. Figure: time / N.
  The engine's fixed cost per ``backward()`` call (task set-up and, on CUDA, the hand-off to
  autograd's device thread and back) is paid once per chain, as it is once per training
  step; the row ``x * w, own backward()`` pays it once per call, so the difference of its
  backward figure from ``x * w``'s estimates it.
- **no-grad forward**: the same chain under ``torch.no_grad()`` (the inference path).

Two other ways were rejected. Timing ``y.backward(g)`` of fresh one-call graphs minus the
forward alone takes the difference of two noisy figures, and each call would pay the engine's
fixed cost, which a model pays once per step. Repeating ``torch.autograd.grad(y, ...,
retain_graph=True)`` on prebuilt graphs also pays that fixed cost per call, keeps the saved
tensors (their freeing goes uncounted) and writes no ``.grad`` (no ``AccumulateGrad``).

Rounds are interleaved (each round times every implementation once, the order rotated by one
each round) after untimed warm-up rounds, and the figures are medians over rounds, so a
noisy spell of a shared machine hits all implementations alike. The baseline ``x * w`` (one
aten op: a broadcast multiply by the weight, whose backward also reduces and accumulates the
weight's gradient), timed the same way, calibrates the host's speed: ``÷ op`` is an
implementation's forward+backward over the op's, comparable across machines.

Every figure includes the device work of a call where the device is slower than the host,
which at 64 rows it is not on a GPU. On the CPU the figures include the arithmetic itself,
small at the ``--quick`` shape (8 × 64): there the suite is a smoke test.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab2bench.suites.base import Suite, comma_list, positive_int, show_report

NAME = "norm-host"
DEFAULT_ROWS = 64
DEFAULT_HIDDEN = (1024,)  # the medium preset's width
QUICK_ROWS = 8
QUICK_HIDDEN = (64,)
DEFAULT_CALLS, QUICK_CALLS = 100, 10
DEFAULT_ROUNDS, QUICK_ROUNDS = 21, 3
DEFAULT_WARMUP, QUICK_WARMUP = 3, 1
#: The one-op baselines (not norms): chained like the norms, and with a backward() per call.
OP = "x * w"
OP_EACH = "x * w, own backward()"
#: The implementation ``×F.rms_norm`` compares to (the issue's goal: at most its host time).
REFERENCE = "F.rms_norm"
PHASES = ("fwd", "bwd", "fwdbwd", "fwd_nograd")

COLUMNS = ["dtype", "H", "rows", "impl", "fwd_us", "bwd_us", "fwdbwd_us", "fwd_nograd_us",
           "fwdbwd_ops", "fwdbwd_vs_ref"]
HEADERS = {"fwd_us": "fwd µs", "bwd_us": "bwd µs", "fwdbwd_us": "fwd+bwd µs",
           "fwd_nograd_us": "no-grad fwd µs", "fwdbwd_ops": "fwd+bwd ÷ op",
           "fwdbwd_vs_ref": f"fwd+bwd ×{REFERENCE}"}
FLOATFMT = {"fwd_us": ".1f", "bwd_us": ".1f", "fwdbwd_us": ".1f", "fwd_nograd_us": ".1f",
            "fwdbwd_ops": ".2f", "fwdbwd_vs_ref": ".2f"}


def _dtype_name(text: str) -> str:
    from tritonnorm.bench.norm import _dtype_name as parse

    return parse(text)


def _impl_name(text: str) -> str:
    if text in (OP, OP_EACH):
        return text
    from tritonnorm.bench.norm import _impl_name as parse

    return parse(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--impl", type=comma_list(_impl_name), default=None,
                        help="implementations, comma-separated (default: every one of "
                             "`lab2bench norm`'s, plus tritonnorm.rms_norm); the baselines "
                             f"'{OP}' and '{OP_EACH}' are always measured")
    parser.add_argument("--dtype", type=comma_list(_dtype_name), default=None,
                        help="dtypes, comma-separated (default bfloat16 on CUDA, float32 on "
                             "the CPU)")
    parser.add_argument("--hidden", type=comma_list(positive_int), default=None,
                        help=f"hidden sizes H (default {DEFAULT_HIDDEN[0]}; --quick "
                             f"{QUICK_HIDDEN[0]})")
    parser.add_argument("--rows", type=comma_list(positive_int), default=None,
                        help=f"rows of the input, small enough that the device never limits "
                             f"(default {DEFAULT_ROWS}; --quick {QUICK_ROWS})")
    parser.add_argument("--calls", type=positive_int, default=None,
                        help=f"calls per timed chain (default {DEFAULT_CALLS}; --quick "
                             f"{QUICK_CALLS})")
    parser.add_argument("--rounds", type=positive_int, default=None,
                        help=f"timed rounds, the median is reported (default {DEFAULT_ROUNDS}; "
                             f"--quick {QUICK_ROUNDS})")
    parser.add_argument("--warmup", type=int, default=None,
                        help=f"untimed rounds first (default {DEFAULT_WARMUP}; --quick "
                             f"{QUICK_WARMUP})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")


@dataclass
class _Case:
    """One implementation (or baseline) at one shape: its inputs, leaves and samples."""

    name: str
    fn: Callable[..., Any]  # (x, w, b) -> y
    xs: list[Any]  # input leaves: one (chained) or one per call
    ws: list[Any]  # a weight leaf per call
    bs: list[Any]  # a bias leaf per call (LayerNorm's)
    grad: Any
    status: str = "ok"
    note: str = ""
    samples: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})

    @property
    def chained(self) -> bool:
        return len(self.xs) == 1


def _make_case(name: str, fn: Callable[..., Any], x: Any, w: Any, b: Any, g: Any, calls: int,
               *, chained: bool = True) -> _Case:
    # detach() gives new leaves over the same storage: no memory per call.
    def leaves(t: Any, n: int) -> list[Any]:
        return [t.detach().requires_grad_(True) for _ in range(n)]

    return _Case(name, fn, leaves(x, 1 if chained else calls), leaves(w, calls),
                 leaves(b, calls), g)


def _check(case: _Case) -> None:
    """One call and its backward, untimed: raises if the implementation cannot run."""
    y = case.fn(case.xs[0], case.ws[0], case.bs[0])
    y.backward(case.grad)
    _clear_grads(case)


def _clear_grads(case: _Case) -> None:
    for t in (*case.xs, *case.ws, *case.bs):
        t.grad = None


def _round(case: _Case, sync: Callable[[], None]) -> dict[str, float]:
    """Seconds per call of each phase, from one chain (or N separate calls)."""
    import torch

    clock = time.perf_counter
    fn, xs, ws, bs = case.fn, case.xs, case.ws, case.bs
    n = len(ws)
    _clear_grads(case)
    # A fresh copy, untimed: some backwards (Liger's) write into the gradient they get.
    g = case.grad.clone()

    with torch.no_grad():
        sync()
        t0 = clock()
        y = xs[0]
        for i in range(n):
            y = fn(y, ws[i], bs[i])
        sync()
        t1 = clock()
    del y

    outs: list[Any] = []
    sync()
    t2 = clock()
    if case.chained:
        y = xs[0]
        for i in range(n):
            y = fn(y, ws[i], bs[i])
        outs.append(y)
        del y
    else:
        for i in range(n):
            outs.append(fn(xs[i], ws[i], bs[i]))
    sync()
    t3 = clock()
    for out in outs:
        out.backward(g)
    sync()
    t4 = clock()
    del outs
    _clear_grads(case)
    fwd, bwd = (t3 - t2) / n, (t4 - t3) / n
    return {"fwd_nograd": (t1 - t0) / n, "fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}


def _impls(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    from tritonnorm.bench.norm_impls import default_impls

    if args.impl:
        return [n for n in dict.fromkeys(args.impl) if n not in (OP, OP_EACH)], []
    return default_impls(args.quick)


def _short(err: BaseException, limit: int = 300) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _median_us(values: list[float]) -> float:
    import statistics

    return statistics.median(values) * 1e6


def measure_cell(impl_names: list[str], *, dtype: Any, hidden: int, rows: int, device: Any,
                 calls: int, rounds: int, warmup: int, seed: int = 0) -> list[dict[str, Any]]:
    """Host µs per call of each implementation and of the baselines at one shape.

    Returns one dict per case: ``impl``, ``status`` (``ok``, ``skipped`` or ``failed``),
    ``note``, and for ``ok`` the medians over rounds ``fwd_us``, ``bwd_us``, ``fwdbwd_us``,
    ``fwd_nograd_us``, the minima ``*_min_us`` and every round's figure under
    ``samples_us``.
    """
    import torch

    from lab2bench.devices import synchronize
    from tritonnorm.bench.norm_impls import IMPLS, Unavailable

    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen, device=device).to(dtype)
    w = (0.5 + torch.rand(hidden, generator=gen, device=device)).to(dtype)
    b = (0.1 * torch.randn(hidden, generator=gen, device=device)).to(dtype)
    g = torch.randn(rows, hidden, generator=gen, device=device).to(dtype)
    ones = torch.ones_like(w)  # the baseline's weight: a chain of x * w keeps x's scale

    def op(x: Any, w: Any, b: Any) -> Any:
        return x * w

    cases = [_make_case(OP, op, x, ones, b, g, calls),
             _make_case(OP_EACH, op, x, ones, b, g, calls, chained=False)]
    for name in impl_names:
        try:
            fn = IMPLS[name].prepare(w, b)
        except Unavailable as err:
            cases.append(_Case(name, None, [], [], [], None, status="skipped", note=str(err)))
            continue
        except Exception as err:
            cases.append(_Case(name, None, [], [], [], None, status="skipped",
                               note=f"raised {type(err).__name__}: {_short(err)}"))
            continue
        cases.append(_make_case(name, fn, x, w, b, g, calls))
    for case in cases:
        if case.status != "ok":
            continue
        try:
            _check(case)
        except Exception as err:  # an implementation's limit (device, shape): not ours
            case.status, case.note = "skipped", f"raised {type(err).__name__}: {_short(err)}"

    def sync() -> None:
        synchronize(device)

    for rnd in range(warmup + rounds):
        live = [c for c in cases if c.status == "ok"]
        shift = rnd % len(live) if live else 0
        for case in live[shift:] + live[:shift]:
            try:
                timed = _round(case, sync)
            except Exception as err:
                case.status = "failed"
                case.note = f"round {rnd} raised {type(err).__name__}: {_short(err)}"
                _clear_grads(case)
                sync()
                continue
            if rnd >= warmup:
                for phase, seconds in timed.items():
                    case.samples[phase].append(seconds)

    out = []
    for case in cases:
        row: dict[str, Any] = {"impl": case.name, "status": case.status, "note": case.note}
        if case.status == "ok":
            for phase in PHASES:
                row[f"{phase}_us"] = _median_us(case.samples[phase])
            for phase in PHASES:  # the quietest round: noise only adds time
                row[f"{phase}_min_us"] = min(case.samples[phase]) * 1e6
            row["samples_us"] = {p: [s * 1e6 for s in v] for p, v in case.samples.items()}
        out.append(row)
    return out


def _add_ratios(cell: list[dict[str, Any]]) -> None:
    """``fwdbwd_ops`` (÷ the one-op baseline) and ``fwdbwd_vs_ref`` (F.rms_norm's / this)."""
    by_name = {r["impl"]: r for r in cell if r["status"] == "ok"}
    op = by_name.get(OP, {}).get("fwdbwd_us")
    ref = by_name.get(REFERENCE, {}).get("fwdbwd_us")
    for r in by_name.values():
        if op:
            r["fwdbwd_ops"] = r["fwdbwd_us"] / op
        if ref and r["impl"] not in (OP, OP_EACH):
            r["fwdbwd_vs_ref"] = ref / r["fwdbwd_us"]


def run(args: argparse.Namespace) -> int:
    import torch

    from lab2bench.devices import resolve_device
    from lab2bench.env import env_info
    from lab2bench.records import Recorder

    device = resolve_device(args.device or ("cpu" if args.quick else None))
    quick = args.quick
    calls = args.calls or (QUICK_CALLS if quick else DEFAULT_CALLS)
    rounds = args.rounds or (QUICK_ROUNDS if quick else DEFAULT_ROUNDS)
    warmup = args.warmup if args.warmup is not None else (QUICK_WARMUP if quick
                                                          else DEFAULT_WARMUP)
    if warmup < 0:
        raise SystemExit(f"lab2bench {NAME}: --warmup must be >= 0")
    dtypes = args.dtype or (["bfloat16"] if device.type == "cuda" else ["float32"])
    hiddens = args.hidden or (QUICK_HIDDEN if quick else DEFAULT_HIDDEN)
    row_counts = args.rows or ([QUICK_ROWS] if quick else [DEFAULT_ROWS])
    impl_names, notes = _impls(args)
    env = env_info(device)
    recorder = Recorder(Path(args.out) / f"{NAME}.jsonl", env=env) if args.out else None

    rows: list[dict[str, Any]] = []
    for dtype_name in dtypes:
        for hidden in hiddens:
            for nrows in row_counts:
                cell = measure_cell(impl_names, dtype=getattr(torch, dtype_name), hidden=hidden,
                                    rows=nrows, device=device, calls=calls, rounds=rounds,
                                    warmup=warmup, seed=args.seed)
                _add_ratios(cell)
                for r in cell:
                    r.update(dtype=dtype_name, H=hidden, rows=nrows)
                    if r["status"] != "ok":
                        notes.append(f"{r['impl']} at {dtype_name} H={hidden} rows={nrows}: "
                                     f"{r['status']}: {r['note']}")
                    if recorder is not None:
                        config = {k: r[k] for k in ("dtype", "H", "rows", "impl")}
                        config.update(device=str(device), calls=calls, rounds=rounds,
                                      warmup=warmup)
                        recorder.record(NAME, config,
                                        {k: v for k, v in r.items() if k not in config})
                rows.extend(cell)

    ok_rows = [r for r in rows if r["status"] == "ok"]
    preamble = [
        f"Device: {env['device_name']} ({device}); torch {torch.__version__}, "
        f"{torch.get_num_threads()} CPU threads. Host time per call, median of {rounds} "
        f"interleaved rounds after {warmup} warm-up; each round times a chain of {calls} "
        "calls (each on the previous output, with its own weight leaf) between device "
        "synchronisations.",
        "fwd: autograd recording (saving for backward counted); bwd: one backward() of the "
        f"chain / {calls} (nodes and the weights' AccumulateGrad; the engine's fixed cost per "
        f"backward() spread over the chain: '{OP_EACH}' pays it per call); no-grad fwd: the "
        f"chain under torch.no_grad(). '÷ op' = fwd+bwd / that of '{OP}' (one aten op); "
        f"'×{REFERENCE}' = {REFERENCE}'s fwd+bwd / this one (>1: cheaper on the host).",
    ]
    if device.type != "cuda":
        preamble.append("On the CPU the figures include the arithmetic itself.")
    md = show_report(args.out or None, NAME, title="RMSNorm host cost per call", rows=ok_rows,
                     columns=COLUMNS, headers=HEADERS, floatfmt=FLOATFMT, preamble=preamble,
                     notes=notes)
    if md is not None:
        print(f"wrote {Path(args.out) / (NAME + '.jsonl')} and {md}", file=sys.stderr)
    return 1 if any(r["status"] == "failed" for r in rows) else 0


SUITE = Suite(
    name=NAME,
    help="RMSNorm host cost: CPU µs per forward and per backward call of each implementation",
    add_arguments=add_arguments,
    run=run,
)
