"""The host (CPU) time of one RMSNorm call, forward and backward, per implementation.

    python packages/tritonnorm/benchmarks/host_time.py --device cuda    # bf16, 64 x 1,024
    python packages/tritonnorm/benchmarks/host_time.py --quick          # CPU smoke run

Inside a model a norm's kernels are short, so a step can be limited by the host's time to
issue them (Python, autograd, the launch path). Inputs are small (64 × H) so that the device
never limits; each figure is ``time.perf_counter`` from a synchronised start to one
synchronisation after the last call, divided by the N calls of a chain:

- **fwd**: N calls, each on the previous output with a weight leaf of its own (as every norm
  of a model has), autograd recording, so what is saved for backward is counted;
- **bwd**: one ``backward(g)`` of that chain: N backward nodes and N ``AccumulateGrad`` into
  ``.grad`` set to None. The engine's fixed cost per ``backward()`` is paid once per chain, as
  once per step; ``x * w, own backward()`` pays it per call (its difference from ``x * w``
  estimates it);
- **no-grad fwd**: the chain under ``torch.no_grad()``.

(Timing fresh one-call graphs would pay the engine's fixed cost per call; repeating
``autograd.grad(retain_graph=True)`` keeps the saved tensors and writes no ``.grad``.)

Each round times every implementation once, in an order rotated each round, after warm-up
rounds; figures are medians over rounds. ``x * w`` (one aten op) calibrates the host:
``÷ op`` = fwd+bwd / the op's; ``×F.rms_norm`` = F.rms_norm's fwd+bwd / this one (>1:
cheaper on the host). On the CPU the figures include the arithmetic.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from impls import ALL, DTYPES, IMPLS, SLOW_SETUP, parse_dtypes, parse_impls, parse_ints, short

from lab2bench.env import env_info
from lab2bench.records import Recorder, atomic_write_text
from lab2bench.report import markdown_table

#: The one-op baselines (not norms): chained like the norms, and with a backward() per call.
OP, OP_EACH = "x * w", "x * w, own backward()"
REFERENCE = "F.rms_norm"
PHASES = ("fwd", "bwd", "fwdbwd", "fwd_nograd")
HEADERS = {"fwd_us": "fwd µs", "bwd_us": "bwd µs", "fwdbwd_us": "fwd+bwd µs",
           "fwd_nograd_us": "no-grad fwd µs", "fwdbwd_ops": "fwd+bwd ÷ op",
           "fwdbwd_vs_ref": f"fwd+bwd ×{REFERENCE}"}
FLOATFMT = {k: ".1f" if k.endswith("_us") else ".2f" for k in HEADERS}


class Case:
    """One implementation (or baseline) at one shape: its leaves and samples per phase."""

    def __init__(self, name: str, fn, x, w, b, g, calls: int, chained: bool = True) -> None:
        # detach() gives new leaves over the same storage: no memory per call.
        leaves = lambda t, n: [t.detach().requires_grad_(True) for _ in range(n)]  # noqa: E731
        self.name, self.fn, self.g, self.note = name, fn, g, ""
        self.xs = leaves(x, 1 if chained else calls)
        self.ws, self.bs = leaves(w, calls), leaves(b, calls)
        self.samples: dict[str, list[float]] = {p: [] for p in PHASES}

    def clear(self) -> None:
        for t in (*self.xs, *self.ws, *self.bs):
            t.grad = None

    def round(self, sync) -> dict[str, float]:
        """Seconds per call of each phase, from one chain (or N separate calls)."""
        fn, xs, ws, bs, n = self.fn, self.xs, self.ws, self.bs, len(self.ws)
        self.clear()
        g = self.g.clone()  # untimed: some backwards (Liger's) write into their gradient

        def chain():
            y = xs[0]
            for i in range(n):
                y = fn(y, ws[i], bs[i])
            return [y]

        with torch.no_grad():
            sync()
            t0 = time.perf_counter()
            ys = chain()
            sync()
            t1 = time.perf_counter()
        del ys  # freed outside the timed region
        sync()
        t2 = time.perf_counter()
        outs = chain() if len(xs) == 1 else [fn(xs[i], ws[i], bs[i]) for i in range(n)]
        sync()
        t3 = time.perf_counter()
        for out in outs:
            out.backward(g)
        sync()
        t4 = time.perf_counter()
        del outs
        self.clear()
        fwd, bwd = (t3 - t2) / n, (t4 - t3) / n
        return {"fwd_nograd": (t1 - t0) / n, "fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}


def measure_cell(names: list[str], dtype, hidden: int, rows: int, device, calls: int,
                 rounds: int, warmup: int, seed: int) -> list[dict]:
    """One row per implementation: ``impl``, ``status`` (ok, skipped, failed), ``note``, and
    for ``ok`` the medians over rounds ``*_us``, the minima ``*_min_us`` and ``samples_us``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x, g = (torch.randn(rows, hidden, generator=gen, device=device).to(dtype) for _ in "xg")
    w = (0.5 + torch.rand(hidden, generator=gen, device=device)).to(dtype)
    b = (0.1 * torch.randn(hidden, generator=gen, device=device)).to(dtype)
    ones = torch.ones_like(w)  # the baseline's weight: a chain of x * w keeps x's scale

    def op(x, w, b):
        return x * w

    cases = [Case(OP, op, x, ones, b, g, calls), Case(OP_EACH, op, x, ones, b, g, calls,
                                                      chained=False)]
    status = {OP: "ok", OP_EACH: "ok"}
    for name in names:
        try:
            case = Case(name, ALL[name](w, b), x, w, b, g, calls)
            case.fn(case.xs[0], case.ws[0], case.bs[0]).backward(g)  # can it run here?
            case.clear()
            cases.append(case)
            status[name] = "ok"
        except Exception as err:  # Unavailable, or an implementation's limit: not ours
            status[name] = f"skipped: {short(err)}"

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for rnd in range(warmup + rounds):
        live = [c for c in cases if status[c.name] == "ok"]
        shift = rnd % len(live)
        for case in live[shift:] + live[:shift]:
            try:
                timed = case.round(sync)
            except Exception as err:
                status[case.name] = f"failed: round {rnd}: {short(err)}"
                case.clear()
                sync()
                continue
            for phase, seconds in timed.items():
                if rnd >= warmup:
                    case.samples[phase].append(seconds)
    out = [{"impl": n, "status": s.split(":")[0], "note": s.partition(": ")[2]}
           for n, s in status.items()]
    for row, case in ((r, c) for r in out for c in cases if c.name == r["impl"]):
        if row["status"] == "ok":
            for phase, values in case.samples.items():
                row[f"{phase}_us"] = statistics.median(values) * 1e6
                row[f"{phase}_min_us"] = min(values) * 1e6  # the quietest round
            row["samples_us"] = {p: [s * 1e6 for s in v] for p, v in case.samples.items()}
    ok = {r["impl"]: r for r in out if r["status"] == "ok"}
    for r in ok.values():
        r["fwdbwd_ops"] = r["fwdbwd_us"] / ok[OP]["fwdbwd_us"]
        if REFERENCE in ok and r["impl"] not in (OP, OP_EACH):
            r["fwdbwd_vs_ref"] = ok[REFERENCE]["fwdbwd_us"] / r["fwdbwd_us"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", type=parse_impls, help="comma-separated (default all; --quick "
                   f"leaves out {', '.join(SLOW_SETUP)}); the baselines always run")
    p.add_argument("--dtype", type=parse_dtypes, help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--hidden", type=parse_ints, help="hidden sizes (default 1024; --quick 64)")
    p.add_argument("--rows", type=parse_ints, help="rows (default 64; --quick 8)")
    p.add_argument("--calls", type=int, help="calls per timed chain (default 100; --quick 10)")
    p.add_argument("--rounds", type=int, help="timed rounds (default 21; --quick 3)")
    p.add_argument("--warmup", type=int, help="untimed rounds first (default 3; --quick 1)")
    p.add_argument("--quick", action="store_true", help="tiny shapes on the CPU: a smoke run")
    p.add_argument("--device", help="default cuda where available (--quick: cpu)")
    p.add_argument("--out", type=Path, help="folder for norm-host.jsonl and norm-host.md")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    q = a.quick
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() and not q else "cpu"))
    calls, rounds = a.calls or (10 if q else 100), a.rounds or (3 if q else 21)
    warmup = a.warmup if a.warmup is not None else (1 if q else 3)
    names = a.impl or [n for n in IMPLS if not (q and n in SLOW_SETUP)]
    env = env_info(device)
    recorder = Recorder(a.out / "norm-host.jsonl", env=env) if a.out else None
    rows = []
    for dtype in a.dtype or (["bfloat16"] if device.type == "cuda" else ["float32"]):
        for hidden in a.hidden or [64 if q else 1024]:
            for n in a.rows or [8 if q else 64]:
                cell = measure_cell(names, DTYPES[dtype], hidden, n, device, calls, rounds,
                                    warmup, a.seed)
                for r in cell:
                    r.update(dtype=dtype, H=hidden, rows=n)
                    if recorder:
                        config = {k: r[k] for k in ("dtype", "H", "rows", "impl")}
                        config.update(device=str(device), calls=calls, rounds=rounds,
                                      warmup=warmup)
                        recorder.record("norm-host", config,
                                        {k: v for k, v in r.items() if k not in config})
                rows += cell
    md = [f"# RMSNorm host cost per call, {env['device_name']} ({device})", "",
          f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads; median of "
          f"{rounds} rounds after {warmup} warm-up, chains of {calls} calls.", "",
          markdown_table([r for r in rows if r["status"] == "ok"],
                         ["dtype", "H", "rows", "impl", *HEADERS], FLOATFMT, headers=HEADERS)]
    md += [f"- {r['impl']} at {r['dtype']} H={r['H']}: {r['status']}: {r['note']}"
           for r in rows if r["status"] != "ok"]
    print("\n".join(md))
    if a.out:
        atomic_write_text(a.out / "norm-host.md", "\n".join(md) + "\n")
    return 1 if any(r["status"] == "failed" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
