"""GPU correctness check, tuning sweep and benchmark table for tritonnorm (run on a CUDA box).

Usage (from the repository root):
    PYTHONPATH=packages/tritonnorm/src python3 packages/tritonnorm/benchmarks/gpu_check.py \
        [--check] [--overhead] [--tune] [--tune-fwd] [--tune-large] [--tune-coop] \
        [--table] [--large] [--baselines] [--fused-add] [--budget-s S]

Bandwidth = minimum bytes / median time (forward: read x + write y; forward+backward:
also read x and dy and write dx), as a share of the copy bandwidth measured in the same
run (read + write of a large device-to-device copy). ``--fused-add`` times
``fused_add_rms_norm`` the same way (its minimum bytes are in ``fused_add_table``).

Dry run on the CPU (tiny shapes, Triton's interpreter; catches crashes in this script):
    TN_DRYRUN=1 TRITON_INTERPRET=1 PYTHONPATH=packages/tritonnorm/src \
        python3 packages/tritonnorm/benchmarks/gpu_check.py --check --table ...
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

import tritonnorm
from tritonnorm import (
    RMSNorm,
    RMSNormFunction,
    fused_add_rms_norm,
    ops,
    rms_norm,
    rms_norm_reference,
)
from tritonnorm.ops import OPTIONS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ROWS, HS = 50_000, (1024, 2048, 4096, 8192)
LARGE_ROWS, LARGE_HS = 4096, (16384, 32768, 65536, 131072)
FUSED_ADD_HS, FUSED_ADD_DTYPES = (1024, 4096), ("bfloat16", "float32")
# TN_DRYRUN=1 (with TRITON_INTERPRET=1): tiny shapes on the CPU, to catch crashes in this
# script before spending device time.
DRY = os.environ.get("TN_DRYRUN") == "1"
# Where overhead.txt and table.md go: $OUT, else the working directory, but never for a
# dry run, whose figures mean nothing (a temporary directory then).
OUT = os.environ.get("OUT") or (tempfile.mkdtemp(prefix="gpu_check-") if DRY else ".")
DEV = "cpu" if DRY else "cuda"
if DRY:
    ROWS, HS, LARGE_ROWS, FUSED_ADD_HS = 5, (64,), 3, (64,)


def sync():
    if not DRY:
        torch.cuda.synchronize()


def log(*a):
    print(*a, flush=True)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def bench(fn, grad_to_none=None, rep=100):
    if DRY:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return do_bench(fn, warmup=rep // 4, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def graph_bench(fn, rep=100):
    """Median ms per call of ``fn`` replayed from a CUDA graph: device time only."""
    if DRY:
        return bench(fn)
    return do_bench_cudagraph(fn, rep=rep, return_mode="median")


DEADLINE = [float("inf")]


def out_of_time():
    return time.time() > DEADLINE[0]


def copy_bandwidth():
    n = 1 << (10 if DRY else 29)  # 2 GiB
    a = torch.randn(n, device=DEV)
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a))
    return 2 * n * 4 / ms / 1e6  # GB/s


def check():
    tol = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 2e-3}
    fails = 0
    for dt, H, rows in itertools.product(
        DTYPES.values(), (1, 300, 4097, 12288, 20000, 131072), (37,)
    ):
        for wdt in {dt, torch.float32}:
            if H * rows > 40_000_000:
                continue
            x = (torch.randn(rows, H, device=DEV) * 3 + 0.5).to(dt).requires_grad_()
            w = torch.randn(H, device=DEV, dtype=wdt).requires_grad_()
            y = rms_norm(x, w)
            dy = torch.randn_like(y)
            dy_copy = dy.clone()
            y.backward(dy)
            xr = x.detach().double().requires_grad_()
            wr = w.detach().double().requires_grad_()
            rms_norm_reference(xr, wr).backward(dy.double())
            yr = rms_norm_reference(x.detach().double(), w.detach().double())
            # dx = r * (g*dy - x_hat*c) is a difference of larger terms (at H = 1 it nearly
            # cancels): measure its error against the size of the terms, as the CPU tests do.
            r = torch.rsqrt(xr.detach().pow(2).mean(-1, keepdim=True) + 1e-5)
            dx_scale = (r * wr.detach() * dy.double()).norm().item()
            e_dx = (x.grad.double() - xr.grad).norm().item() / max(xr.grad.norm().item(),
                                                                    dx_scale)
            # dweight is a sum over rows that can cancel (at H = 1, x_hat = ±1): measure
            # its error against the size of the summed terms too.
            dw_scale = (dy.double().abs() * (xr.detach() * r).abs()).sum(0).norm().item()
            e_dw = (w.grad.double() - wr.grad).norm().item() / max(wr.grad.norm().item(),
                                                                    dw_scale)
            errs = (rel(y, yr), e_dx, e_dw)
            ok = max(errs) < tol[dt] and torch.equal(dy, dy_copy) and w.grad.dtype == wdt
            ok = ok and y.dtype == dt and x.grad.dtype == dt
            if not ok:
                fails += 1
                log("FAIL", dt, wdt, H, rows, errs)
    # non-contiguous x and dy; leading shape; zero rows; determinism; needs_input_grad.
    xb = torch.randn(64, 3, 2 * 768, device=DEV, dtype=torch.bfloat16)[..., ::2]
    xb.requires_grad_()
    w = torch.randn(768, device=DEV, requires_grad=True)
    y = RMSNormFunction.apply(xb, w, 1e-5)
    g = torch.randn(768, 3, 64, device=DEV, dtype=torch.bfloat16).permute(2, 1, 0)
    y.backward(g)
    xr = xb.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_()
    rms_norm_reference(xr, wr).backward(g.double())
    e = (rel(xb.grad, xr.grad), rel(w.grad, wr.grad))
    if max(e) > 1.5e-2:
        fails += 1
        log("FAIL non-contiguous", e)
    x0 = torch.randn(0, 5, 64, device=DEV, requires_grad=True)
    w0 = torch.randn(64, device=DEV, requires_grad=True)
    rms_norm(x0, w0).sum().backward()
    if w0.grad.abs().sum() != 0:
        fails += 1
    for H in (4096, 65536):
        x = torch.randn(3000 if H < 10000 else 300, H, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(H, device=DEV)
        dy = torch.randn_like(x)
        y, rstd = ops.rms_norm_fwd(x, w, 1e-5)
        d1 = ops.rms_norm_bwd(dy, x, w, rstd)[1]
        d2 = ops.rms_norm_bwd(dy, x, w, rstd)[1]
        if not torch.equal(d1, d2):
            fails += 1
            log("FAIL determinism", H)
        dx_only = ops.rms_norm_bwd(dy, x, w, rstd, needs_dw=False)
        if dx_only[1] is not None:
            fails += 1
    # torch.compile fullgraph over a small model using RMSNorm.
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), RMSNorm(512)).to(DEV)
    cmodel = torch.compile(model, fullgraph=True)
    x = torch.randn(8, 16, 512, device=DEV, requires_grad=True)
    # A random projection as the loss: with the norm's weight at ones, sum(out ** 2) is
    # constant (= elements, up to eps), and its gradients would be rounding noise.
    proj = torch.randn(8, 16, 512, device=DEV)
    out = cmodel(x)
    (out * proj).sum().backward()
    gc = [p.grad.clone() for p in model.parameters()]
    ref_out = model(x)
    model.zero_grad()
    (ref_out * proj).sum().backward()
    e = max(rel(a, p.grad) for a, p in zip(gc, model.parameters()))
    if rel(out, ref_out) > 1e-5 or e > 1e-4:
        fails += 1
        log("FAIL compile", rel(out, ref_out), e)
    log(f"check: {fails} failures; torch {torch.__version__} triton {triton.__version__}")
    return fails


def naive(x, w, eps=1e-5):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def fwd_bwd_fn(fn, x, w, dy):
    def run():
        fn(x, w).backward(dy)
    return run


def time_impl(fn, x, w, dy):
    with torch.no_grad():
        f = bench(lambda: fn(x, w))
    x.requires_grad_(True)
    w.requires_grad_(True)
    fb = bench(fwd_bwd_fn(fn, x, w, dy), grad_to_none=[x, w])
    x.requires_grad_(False)
    w.requires_grad_(False)
    x.grad = w.grad = None
    return f, fb


def make(rows, H, dt):
    x = torch.randn(rows, H, device=DEV, dtype=dt)
    w = (1 + 0.1 * torch.randn(H, device=DEV)).to(dt)
    dy = torch.randn(rows, H, device=DEV, dtype=dt)
    return x, w, dy


class _NoopFunction(torch.autograd.Function):
    """The floor of any Python autograd.Function: allocates its outputs, launches nothing."""

    @staticmethod
    def forward(ctx, x, w):
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, g):
        return torch.empty_like(g), None


def _per_call_us(fn, calls=3 if DRY else 1000, grads=()):
    for _ in range(50):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        for t in grads:
            t.grad = None
        fn()
    sync()
    return (time.perf_counter() - t0) / calls * 1e6


class _FwdKernelOnly(torch.autograd.Function):
    """Forward kernel, empty backward: splits the host cost between the two halves."""

    @staticmethod
    def forward(ctx, x, w):
        return ops.rms_norm_fwd(x, w, 1e-5)[0]

    @staticmethod
    def backward(ctx, g):
        return torch.empty_like(g), None


class _BwdKernelOnly(torch.autograd.Function):
    """Empty forward, backward kernels (on saved x, w and a ready rstd)."""

    @staticmethod
    def forward(ctx, x, w, rstd):
        ctx.save_for_backward(x, w, rstd)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, g):
        x, w, rstd = ctx.saved_tensors
        dx, dw = ops.rms_norm_bwd(g, x, w, rstd)
        return dx, dw, None


def overhead():
    """Host cost per call on a one-row input (the GPU work is negligible there)."""
    import gc

    x, w, dy = make(1, 1024, torch.bfloat16)
    rstd = ops.rms_norm_fwd(x, w, 1e-5)[1]
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    lines = []
    can_direct = OPTIONS.direct_launch  # False under the interpreter or an old Triton
    log(f"triton {triton.__version__}: direct launch available: {can_direct}")

    def rec(name, fn, grads=()):
        us = _per_call_us(fn, grads=grads)
        db = bench(fn, grad_to_none=list(grads) or None) * 1e3
        lines.append(f"OVERHEAD {name}: {us:.1f} us/call (1000 calls, no sync); "
                     f"do_bench median {db:.1f} us")
        log(lines[-1])

    for rnd in range(2):  # twice: the host is noisy
        rec(f"[{rnd}] F.rms_norm fwd+bwd",
            lambda: F.rms_norm(xg, (1024,), wg, 1e-5).backward(dy), (xg, wg))
        rec(f"[{rnd}] noop autograd.Function fwd+bwd",
            lambda: _NoopFunction.apply(xg, wg).backward(dy), (xg, wg))
        rec(f"[{rnd}] rms_norm fwd+bwd", lambda: rms_norm(xg, wg).backward(dy), (xg, wg))
        rec(f"[{rnd}] Function: fwd kernel only",
            lambda: _FwdKernelOnly.apply(xg, wg).backward(dy), (xg, wg))
        rec(f"[{rnd}] Function: bwd kernels only",
            lambda: _BwdKernelOnly.apply(xg, wg, rstd).backward(dy), (xg, wg))
        rec(f"[{rnd}] ops.rms_norm_fwd", lambda: ops.rms_norm_fwd(x, w, 1e-5))
        rec(f"[{rnd}] ops.rms_norm_bwd", lambda: ops.rms_norm_bwd(dy, x, w, rstd))
    with torch.no_grad():
        rec("F.rms_norm fwd (no_grad)", lambda: F.rms_norm(x, (1024,), w, 1e-5))
        rec("rms_norm fwd (no_grad)", lambda: rms_norm(x, w))
    if hasattr(torch.autograd, "set_multithreading_enabled"):
        with torch.autograd.set_multithreading_enabled(False):
            rec("rms_norm fwd+bwd, backward on the calling thread",
                lambda: rms_norm(xg, wg).backward(dy), (xg, wg))
            rec("F.rms_norm fwd+bwd, backward on the calling thread",
                lambda: F.rms_norm(xg, (1024,), wg, 1e-5).backward(dy), (xg, wg))
    gc.disable()
    rec("rms_norm fwd+bwd, gc disabled", lambda: rms_norm(xg, wg).backward(dy), (xg, wg))
    gc.enable()
    with OPTIONS.override(direct_launch=False):
        rec("rms_norm fwd+bwd, launch through the JIT",
            lambda: rms_norm(xg, wg).backward(dy), (xg, wg))
    with OPTIONS.override(fold_dw_sum=False):
        rec("rms_norm fwd+bwd, dweight summed by a second kernel",
            lambda: rms_norm(xg, wg).backward(dy), (xg, wg))
        with OPTIONS.override(dw_reduce="torch"):
            rec("rms_norm fwd+bwd, dweight summed by torch (column sum + cast)",
                lambda: rms_norm(xg, wg).backward(dy), (xg, wg))
    # Direct launches must give bitwise what the JIT launch gives, in every path.
    fails = 0
    cases = ((torch.bfloat16, 1024, 999), (torch.float32, 300, 37),
             (torch.float16, 20000, 33), (torch.bfloat16, 65536, 21))
    for dt, H, rows in cases[1:2] if DRY else cases:
        x, w, dy = make(rows, H, dt)
        outs = []
        for direct in (False, True, True):
            with OPTIONS.override(direct_launch=direct and can_direct):
                y, r = ops.rms_norm_fwd(x, w, 1e-5)
                outs.append((y, *ops.rms_norm_bwd(dy, x, w, r)))
        for o in outs[1:]:
            if not all(torch.equal(a, b) for a, b in zip(outs[0], o)):
                fails += 1
                log("FAIL direct launch differs", dt, H, rows)
    log(f"direct-launch equality: {fails} failures")
    with open(os.path.join(OUT, "overhead.txt"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return fails


def _sweep(label, nbytes, fn, cfgs, bw, top=4):
    """Time each config (the first is the current default); return [(%, ms, cfg)] best first."""
    res = []
    for cfg in cfgs[:2] if DRY else cfgs:
        if out_of_time():
            log("out of time")
            break
        try:
            ms = bench(lambda cfg=cfg: fn(cfg), rep=25)
        except Exception as e:  # noqa: BLE001 - a config that fails to compile or run
            log(f"  {label} {cfg} failed: {type(e).__name__}: {str(e)[:100]}")
            continue
        res.append((nbytes / ms / 1e6 / bw * 100, ms, cfg))
    if res:
        log(f"TUNE {label}: default {res[0][0]:.1f}% {res[0][1] * 1e3:.0f}us")
    res.sort(key=lambda r: -r[0])
    log(f"TUNE {label}: " + "; ".join(f"{p:.1f}% {ms * 1e3:.0f}us {c}" for p, ms, c in res[:top]))
    return res


def _better(res, default_cfg, margin=1.02):
    """The best config if it beats the default by more than ``margin``, else None."""
    if not res:
        return None
    default = [r for r in res if r[2] == default_cfg]
    if default and res[0][1] * margin > default[0][1]:
        return None
    return res[0][2]


def tune(bw):
    """Backward configs where fwd+bwd fell short; the winners go into the launch tables."""
    cells = [(torch.bfloat16, ROWS, 1024), (torch.bfloat16, ROWS, 2048),
             (torch.float32, ROWS, 1024), (torch.float32, ROWS, 2048),
             (torch.bfloat16, LARGE_ROWS, 16384)]
    for dt, rows, H in cells:
        x, w, dy = make(rows, H, dt)
        es = x.element_size()
        _, rstd = ops.rms_norm_fwd(x, w, 1e-5)
        name = f"{str(dt)[6:]} {rows}x{H}"
        bh, cfg0 = ops.bwd_config(H, es)
        keys = ("block_r", "num_warps", "programs_per_sm", "row_sum", "stages")
        default = {k: getattr(cfg0, k) for k in keys}
        cfgs = [default]
        # Tiles of 4-64 elements per thread; pipelined (stages > 1) or register-prefetched.
        for br, nw, per_sm, st, rs in itertools.product((1, 2, 4, 8), (4, 8, 16), (1, 2),
                                                        (1, 3, 4), (False, True)):
            ept = br * H // (nw * 32)
            smem = br * H * es * 2 * st * per_sm
            if 4 <= ept <= 64 and smem <= 220_000 and not (per_sm == 2 and nw == 16):
                cfgs.append(dict(zip(keys, (br, nw, per_sm, rs, st))))
        cfgs = [c for i, c in enumerate(cfgs) if c not in cfgs[:i]]
        res = _sweep(f"bwd {name}", 3 * x.numel() * es,
                     lambda cfg, x=x, w=w, dy=dy, r=rstd: ops.rms_norm_bwd(dy, x, w, r,
                                                                              config=cfg),
                     cfgs, bw)
        best = _better(res, default)
        if best is not None:
            value = ops.BwdConfig(**best)
            ops.BWD_TUNED[(es, bh)] = value
            ops.clear_plan_caches()
            log(f"APPLY BWD_TUNED[({es}, {bh})] = {value}")


def tune_large(bw):
    """Looped kernels at H = 65,536 and 131,072 (4,096 rows, bfloat16); winners applied."""
    data = [(H, *make(LARGE_ROWS, H, torch.bfloat16)) for H in (65536, 131072)]
    fwd_cfgs = [(OPTIONS.loop_chunk, ops.LOOP.fwd_warps, ops.LOOP.fwd_programs_per_sm),
                (8192, 16, 1), (16384, 16, 1), (16384, 32, 1), (32768, 32, 1), (16384, 16, 2),
                (8192, 8, 1), (32768, 16, 1)]
    bwd_cfgs = [(OPTIONS.loop_chunk_bwd, ops.LOOP.bwd_warps, ops.LOOP.bwd_programs_per_sm),
                (4096, 8, 4), (8192, 8, 2), (8192, 16, 2), (4096, 4, 8), (2048, 4, 8),
                (8192, 8, 4)]
    totals = {}
    for H, x, w, dy in data:
        _, rstd = ops.rms_norm_fwd(x, w, 1e-5)
        for kind, grid, nbytes in (("fwd", fwd_cfgs, 4 * x.numel()),
                                   ("bwd", bwd_cfgs, 6 * x.numel())):
            cfgs = [{"looped": True, "chunk": c, "num_warps": nw, "programs_per_sm": p}
                    for c, nw, p in grid]
            if kind == "fwd":
                fn = lambda cfg, x=x, w=w: ops.rms_norm_fwd(x, w, 1e-5, config=cfg)  # noqa: E731
            else:
                fn = lambda cfg, x=x, w=w, dy=dy, r=rstd: ops.rms_norm_bwd(  # noqa: E731
                    dy, x, w, r, config=cfg)
            for _p, ms, cfg in _sweep(f"{kind} bf16 4096x{H}", nbytes, fn, cfgs, bw):
                key = (kind, cfg["chunk"], cfg["num_warps"], cfg["programs_per_sm"])
                totals.setdefault(key, []).append(ms)
    for kind, grid in (("fwd", fwd_cfgs), ("bwd", bwd_cfgs)):
        # One looped setting serves every long row: pick the least total time over both H.
        timed = {k[1:]: sum(v) for k, v in totals.items() if k[0] == kind and len(v) == 2}
        if not timed or grid[0] not in timed:
            continue
        best = min(timed, key=timed.get)
        log(f"LOOPED {kind}: default {grid[0]} {timed[grid[0]] * 1e3:.0f}us, "
            f"best {best} {timed[best] * 1e3:.0f}us")
        if timed[best] * 1.02 < timed[grid[0]]:
            # The sweep ran bfloat16, where the looped forward's chunk is loop_chunk.
            if kind == "fwd":
                OPTIONS.loop_chunk, warps, per_sm = best
                ops.LOOP = dataclasses.replace(ops.LOOP, fwd_warps=warps,
                                              fwd_programs_per_sm=per_sm)
            else:
                OPTIONS.loop_chunk_bwd, warps, per_sm = best
                ops.LOOP = dataclasses.replace(ops.LOOP, bwd_warps=warps,
                                              bwd_programs_per_sm=per_sm)
            ops.clear_plan_caches()
            log(f"APPLY looped {kind} (chunk, warps, per SM) = {best}")
    # H = 32,768: fused (one block per row) or looped forward?
    x, w, _ = make(LARGE_ROWS, 32768, torch.bfloat16)
    fused = {"looped": False, "block_r": 1, "num_warps": 16, "programs_per_sm": 0}
    looped = {"looped": True}
    res = _sweep("fwd bf16 4096x32768", 4 * x.numel(),
                 lambda cfg: ops.rms_norm_fwd(x, w, 1e-5, config=cfg),
                 [fused, looped, dict(fused, num_warps=32)], bw)
    if res and res[0][2] is looped:
        OPTIONS.max_fused_block_fwd = 16384
        ops.clear_plan_caches()
        log("APPLY OPTIONS.max_fused_block_fwd = 16384")
    elif res and res[0][2]["num_warps"] == 32 and res[0][1] * 1.02 < min(
            r[1] for r in res if r[2] is fused):
        ops.FWD_TUNED[(2, 32768)] = ops.FwdConfig(1, 32)
        ops.clear_plan_caches()
        log(f"APPLY FWD_TUNED[(2, 32768)] = {ops.FWD_TUNED[(2, 32768)]}")


def tune_fwd(bw):
    """Forward launch configs (one read of x, or two with the second from L2) in every
    50,000-row cell; winners by more than 2% go into the table."""
    cells = [(dt, H) for dt in (torch.float32, torch.bfloat16) for H in HS]
    for dt, H in cells:
        x, w, _ = make(ROWS, H, dt)
        es = x.element_size()
        bh, cfg0 = ops.fwd_config(H, es)
        keys = ("block_r", "num_warps", "chunk")
        default = {k: getattr(cfg0, k) for k in keys}
        cfgs = [default]
        for br, nw, ch in itertools.product((1, 2, 4, 8), (4, 8, 16),
                                            (0, 512, 1024, 2048, 4096)):
            ept = br * (ch or bh) // (nw * 32)  # elements per thread in registers
            if 4 <= ept <= 64 and ch <= bh:
                cfgs.append(dict(zip(keys, (br, nw, ch))))
        cfgs = [c for i, c in enumerate(cfgs) if c not in cfgs[:i]]
        res = _sweep(f"fwd {str(dt)[6:]} {ROWS}x{H}", 2 * x.numel() * es,
                     lambda cfg, x=x, w=w: ops.rms_norm_fwd(x, w, 1e-5, config=cfg), cfgs, bw)
        best = _better(res, default)
        if best is not None:
            # ``even`` was not swept: the timed launches used the table's.
            ops.FWD_TUNED[(es, bh)] = dataclasses.replace(cfg0, **best)
            ops.clear_plan_caches()
            log(f"APPLY FWD_TUNED[({es}, {bh})] = {ops.FWD_TUNED[(es, bh)]}")


def tune_coop(bw):
    """Cooperative long-row kernels per dtype: slice bytes and warps, against the two-pass
    kernels (fwd and bwd timed apart); the best per (kernel, element size) is applied."""
    shapes = [(torch.bfloat16, 32768), (torch.bfloat16, 65536), (torch.bfloat16, 131072),
              (torch.float32, 65536)]
    grid = {"fwd": [(32768, 16), (32768, 32), (16384, 16), (65536, 32)],
            "bwd": [(16384, 8), (16384, 16), (16384, 4), (8192, 4), (8192, 8), (32768, 8)]}
    totals = {}
    for dt, H in shapes:
        x, w, dy = make(LARGE_ROWS, H, dt)
        es = x.element_size()
        _, rstd = ops.rms_norm_fwd(x, w, 1e-5)
        for kind, nbytes in (("fwd", 2 * x.numel() * es), ("bwd", 3 * x.numel() * es)):
            cfgs = [{"looped": True, "coop": False}] + [
                {"looped": True, "coop": True, "coop_block": b // es, "coop_warps": nw}
                for b, nw in grid[kind]]
            if kind == "fwd":
                fn = lambda cfg, x=x, w=w: ops.rms_norm_fwd(x, w, 1e-5, config=cfg)  # noqa: E731
            else:
                fn = lambda cfg, x=x, w=w, dy=dy, r=rstd: ops.rms_norm_bwd(  # noqa: E731
                    dy, x, w, r, config=cfg)
            for _p, ms, cfg in _sweep(f"coop {kind} {str(dt)[6:]} {LARGE_ROWS}x{H}", nbytes, fn,
                                      cfgs, bw, top=5):
                key = (kind, es, cfg.get("coop_block", 0) * es, cfg.get("coop_warps", 0))
                totals.setdefault(key, []).append(ms / nbytes)
    for kind in ("fwd", "bwd"):
        table = ops.COOP_FWD if kind == "fwd" else ops.COOP_BWD
        for es in sorted({k[1] for k in totals if k[0] == kind}):
            # Least summed time per byte over that element size's shapes (configs that
            # ran on all of them; key[2] == 0 is the two-pass baseline).
            n_shapes = sum(dt.itemsize == es for dt, _ in shapes)
            timed = {k[2:]: sum(v) for k, v in totals.items()
                     if k[:2] == (kind, es) and k[2] and len(v) == n_shapes}
            if not timed:
                continue
            best = min(timed, key=timed.get)
            two_pass = sum(totals.get((kind, es, 0, 0), [float("nan")]))
            log(f"COOP {kind} {es}B: best (bytes, warps) {best}; two-pass / best = "
                f"{two_pass / timed[best]:.2f}")
            table[es] = ops.CoopConfig(*best)
            log(f"APPLY COOP_{kind.upper()}[{es}] = {table[es]}")


def cell_numerics(x, w, dy):
    """Relative errors of tritonnorm's y, dx, dweight against float64 on a benchmark cell."""
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = rms_norm(xa, wa)
    y.backward(dy)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    yr = rms_norm_reference(xr, wr)
    yr.backward(dy.double())
    errs = (rel(y, yr), rel(xa.grad, xr.grad), rel(wa.grad, wr.grad))
    tol = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 2e-3}[x.dtype]
    return errs, max(errs) < tol


def table(bw, baselines, large):
    impls = {"tritonnorm": rms_norm}
    fails = 0
    if baselines:
        impls["F.rms_norm"] = lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-5)
        torch._dynamo.config.cache_size_limit = 256
        impls["compile(naive)"] = torch.compile(naive)
    cells = [(n, dt, ROWS, H) for (n, dt), H in itertools.product(DTYPES.items(), HS)]
    if large:
        cells += [("bfloat16", torch.bfloat16, LARGE_ROWS, H) for H in LARGE_HS]
    lines = ["| dtype | rows | H | impl | fwd ms | fwd % | fwd+bwd ms | fwd+bwd % |",
             "|---|---|---|---|---|---|---|---|"]
    for name, dt, rows, H in cells:
        x, w, dy = make(rows, H, dt)
        n = x.numel() * x.element_size()
        for iname, fn in impls.items():
            if out_of_time() and not iname.startswith("tritonnorm"):
                continue
            try:
                f, fb = time_impl(fn, x, w, dy)
            except Exception as e:  # noqa: BLE001 - report and continue the sweep
                log(f"{iname} {name} {H} failed: {type(e).__name__}: {e}")
                continue
            if iname == "tritonnorm":
                errs, ok = cell_numerics(x, w, dy)
                fails += not ok
                log(f"numerics {name} {rows}x{H}: {'ok' if ok else 'FAIL'} "
                    + " ".join(f"{e:.1e}" for e in errs))
            pf, pfb = 2 * n / f / 1e6 / bw * 100, 5 * n / fb / 1e6 / bw * 100
            line = (f"| {name} | {rows} | {H} | {iname} | {f:.3f} | {pf:.0f} "
                    f"| {fb:.3f} | {pfb:.0f} |")
            lines.append(line)
            log(line)
        with open(os.path.join(OUT, "table.md"), "w") as fh:
            fh.write(f"copy bandwidth {bw:.0f} GB/s\n\n" + "\n".join(lines) + "\n")
    with open(os.path.join(OUT, "table.md"), "w") as fh:
        fh.write(f"copy bandwidth {bw:.0f} GB/s\n\n" + "\n".join(lines) + "\n")
    log("\n".join(lines))
    return fails


def _plan(H, es, kind):
    """The launch plan the current tables and options give rows of H (of es bytes)."""
    if (ops.fwd_is_looped if kind == "fwd" else ops.bwd_is_looped)(H):
        return "looped"
    block_h, cfg = (ops.fwd_config if kind == "fwd" else ops.bwd_config)(H, es)
    return f"BLOCK_H={block_h} {cfg}"


def fused_add_numerics(x, r, w, dy, ds):
    """Relative errors of fused_add_rms_norm's y, sum, dx, dresidual, dweight against
    float64 (the sum taken in float64 too: its rounding to x's dtype is within tol)."""
    xa, ra, wa = (t.detach().clone().requires_grad_() for t in (x, r, w))
    y, s = fused_add_rms_norm(xa, ra, wa, 1e-5)
    torch.autograd.backward((y, s), (dy, ds))
    xr, rr, wr = (t.detach().double().requires_grad_() for t in (x, r, w))
    sr = xr + rr
    yr = rms_norm_reference(sr, wr)
    torch.autograd.backward((yr, sr), (dy.double(), ds.double()))
    errs = (rel(y, yr), rel(s, sr), rel(xa.grad, xr.grad), rel(ra.grad, rr.grad),
            rel(wa.grad, wr.grad))
    tol = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 2e-3}[x.dtype]
    return errs, max(errs) < tol


def fused_add_table(bw):
    """fused_add_rms_norm against torch.compile of (x + r) then torch.nn.RMSNorm, forward
    and forward+backward, timed as ``table`` times (do_bench median: eager calls, so the
    host path and autograd count where they exceed the device time); then tritonnorm's
    forward and backward kernels each replayed from a CUDA graph (device time only).

    Minimum bytes: forward reads x and r and writes y and the sum; backward reads dy,
    dsum and the sum and writes dx (and dresidual where r's dtype differs from x's, never
    here: r has x's dtype); forward+backward is the sum of the two.
    """
    torch._dynamo.config.cache_size_limit = 256
    fails = 0
    lines = ["| dtype | rows | H | impl | fwd ms | fwd % | fwd+bwd ms | fwd+bwd % |",
             "|---|---|---|---|---|---|---|---|"]
    graph_lines = []
    for name, H in itertools.product(FUSED_ADD_DTYPES, FUSED_ADD_HS):
        dt = DTYPES[name]
        x, r, dy, ds = (torch.randn(ROWS, H, device=DEV, dtype=dt) for _ in range(4))
        norm = torch.nn.RMSNorm(H, eps=1e-5, device=DEV, dtype=dt)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(H, device=DEV))
        w = norm.weight  # shared: both implementations read (and grad) the same gain

        def add_norm(x, r, norm=norm):
            s = x + r
            return norm(s), s

        impls = {"tritonnorm": lambda x, r, w=w: fused_add_rms_norm(x, r, w, 1e-5),
                 "compile(add+nn.RMSNorm)": torch.compile(add_norm)}
        n = x.numel()
        fwd_bytes = n * (2 * x.element_size() + r.element_size() + x.element_size())
        bwd_bytes = n * (dy.element_size() + ds.element_size() + 2 * x.element_size())
        if r.dtype != x.dtype:
            bwd_bytes += n * r.element_size()
        for iname, fn in impls.items():
            try:
                with torch.no_grad():
                    f = bench(lambda fn=fn, x=x, r=r: fn(x, r))
                for t in (x, r):
                    t.requires_grad_(True)

                def run(fn=fn, x=x, r=r, grads=(dy, ds)):
                    torch.autograd.backward(fn(x, r), grads)

                fb = bench(run, grad_to_none=[x, r, w])
            except Exception as e:  # noqa: BLE001 - report and continue the sweep
                log(f"{iname} {name} {H} failed: {type(e).__name__}: {e}")
                continue
            finally:
                for t in (x, r, w):
                    t.grad = None
                for t in (x, r):
                    t.requires_grad_(False)
            if iname == "tritonnorm":
                errs, ok = fused_add_numerics(x, r, w, dy, ds)
                fails += not ok
                log(f"numerics fused add {name} {ROWS}x{H}: {'ok' if ok else 'FAIL'} "
                    + " ".join(f"{e:.1e}" for e in errs))
            pf = fwd_bytes / f / 1e6 / bw * 100
            pfb = (fwd_bytes + bwd_bytes) / fb / 1e6 / bw * 100
            line = (f"| {name} | {ROWS} | {H} | {iname} | {f:.3f} | {pf:.0f} "
                    f"| {fb:.3f} | {pfb:.0f} |")
            lines.append(line)
            log(line)
        graph_lines.append(fused_add_kernels_line(name, x, r, w, dy, ds, fwd_bytes, bwd_bytes,
                                                  bw))
        log(graph_lines[-1])
    lines += ["", "kernels alone, graph-timed", "",
              "| dtype | rows | H | fwd µs | fwd % | bwd µs | bwd % |",
              "|---|---|---|---|---|---|---|", *graph_lines]
    with open(os.path.join(OUT, "fused_add.md"), "w") as fh:
        fh.write(f"copy bandwidth {bw:.0f} GB/s\n\nfused_add_rms_norm (y, x + r)\n\n"
                 + "\n".join(lines) + "\n")
    log("\n".join(lines))
    return fails


def fused_add_kernels_line(name, x, r, w, dy, ds, fwd_bytes, bwd_bytes, bw):
    """One row: the fused add's forward and backward kernels, each replayed from a CUDA
    graph, as µs and % of the copy bandwidth for their minimum bytes."""
    w = w.detach()
    _, s, rstd = ops.fused_add_rms_norm_fwd(x, r, w, 1e-5)
    f = graph_bench(lambda: ops.fused_add_rms_norm_fwd(x, r, w, 1e-5))
    b = graph_bench(lambda: ops.fused_add_rms_norm_bwd(dy, ds, s, w, rstd, r.dtype))
    pf, pb = (n / t / 1e6 / bw * 100 for n, t in ((fwd_bytes, f), (bwd_bytes, b)))
    return (f"| {name} | {ROWS} | {x.shape[-1]} | {f * 1e3:.1f} | {pf:.0f} | {b * 1e3:.1f} "
            f"| {pb:.0f} |")


def main():
    p = argparse.ArgumentParser()
    for flag in ("check", "overhead", "tune", "tune_fwd", "tune_large", "tune_coop", "table",
                 "large", "baselines", "fused_add"):
        p.add_argument("--" + flag.replace("_", "-"), action="store_true")
    p.add_argument("--budget-s", type=float, default=float("inf"))
    a = p.parse_args()
    t0 = time.time()
    DEADLINE[0] = t0 + a.budget_s
    log("dry run" if DRY else torch.cuda.get_device_name(), tritonnorm.__version__)
    fails = 0
    if a.overhead:  # first: before torch.compile (in --check) starts its workers
        fails += overhead()
        log(f"[{time.time() - t0:.0f}s]")
    if a.check:
        fails += check()
    bw = copy_bandwidth()
    log(f"copy bandwidth (read+write): {bw:.0f} GB/s  [{time.time() - t0:.0f}s]")
    if a.tune:
        # The small-H sweep gets 55% of what is left, the long rows the rest.
        DEADLINE[0] = time.time() + 0.55 * (t0 + a.budget_s - time.time())
        tune(bw)
        DEADLINE[0] = t0 + a.budget_s
        log(f"[{time.time() - t0:.0f}s]")
    if a.tune_large:
        tune_large(bw)
        log(f"[{time.time() - t0:.0f}s]")
    if a.tune_fwd:
        tune_fwd(bw)
        log(f"[{time.time() - t0:.0f}s]")
    if a.tune_coop:
        tune_coop(bw)
        log(f"[{time.time() - t0:.0f}s]")
    if a.tune or a.tune_large:
        log("plans now: " + "; ".join(
            f"{es}B H={H} fwd {_plan(H, es, 'fwd')} bwd {_plan(H, es, 'bwd')}"
            for es, H in itertools.product((4, 2), HS + LARGE_HS)))
        log(f"looped: loop_chunk={OPTIONS.loop_chunk} loop_chunk_bwd="
            f"{OPTIONS.loop_chunk_bwd} {ops.LOOP} "
            f"max_fused_block_fwd={OPTIONS.max_fused_block_fwd}")
    if a.table:
        DEADLINE[0] = float("inf")
        fails += table(bw, a.baselines, a.large)
    if a.fused_add:
        fails += fused_add_table(bw)
    log(f"copy bandwidth (read+write): {bw:.0f} GB/s; total {time.time() - t0:.0f}s")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
