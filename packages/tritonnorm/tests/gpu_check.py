"""GPU correctness check, tuning sweep and benchmark table for tritonnorm (run on a CUDA box).

Usage (from the repository root):
    PYTHONPATH=packages/tritonnorm/src python3 packages/tritonnorm/tests/gpu_check.py \
        [--check] [--tune] [--table] [--large] [--baselines]

Bandwidth = minimum bytes / median time (forward: read x + write y; forward+backward:
also read x and dy and write dx), as a share of the copy bandwidth measured in the same
run (read + write of a large device-to-device copy).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

import tritonnorm
from tritonnorm import RMSNorm, RMSNormFunction, rms_norm, rms_norm_reference
from tritonnorm.ops import kernels

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ROWS, HS = 50_000, (1024, 2048, 4096, 8192)
LARGE_ROWS, LARGE_HS = 4096, (16384, 32768, 65536, 131072)
OUT = os.environ.get("OUT", ".")


def log(*a):
    print(*a, flush=True)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def bench(fn, grad_to_none=None, rep=100):
    return do_bench(fn, warmup=rep // 4, rep=rep, grad_to_none=grad_to_none, return_mode="median")


DEADLINE = [float("inf")]


def out_of_time():
    return time.time() > DEADLINE[0]


def copy_bandwidth():
    a = torch.randn(1 << 29, device="cuda")  # 2 GiB
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a))
    return 2 * (1 << 29) * 4 / ms / 1e6  # GB/s


def check():
    tol = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 2e-3}
    fails = 0
    for dt, H, rows in itertools.product(
        DTYPES.values(), (1, 300, 4097, 12288, 20000, 131072), (37,)
    ):
        for wdt in {dt, torch.float32}:
            if H * rows > 40_000_000:
                continue
            x = (torch.randn(rows, H, device="cuda") * 3 + 0.5).to(dt).requires_grad_()
            w = torch.randn(H, device="cuda", dtype=wdt).requires_grad_()
            y = rms_norm(x, w)
            dy = torch.randn_like(y)
            dy_copy = dy.clone()
            y.backward(dy)
            xr = x.detach().double().requires_grad_()
            wr = w.detach().double().requires_grad_()
            rms_norm_reference(xr, wr).backward(dy.double())
            yr = rms_norm_reference(x.detach().double(), w.detach().double())
            errs = (rel(y, yr), rel(x.grad, xr.grad), rel(w.grad, wr.grad))
            ok = max(errs) < tol[dt] and torch.equal(dy, dy_copy) and w.grad.dtype == wdt
            ok = ok and y.dtype == dt and x.grad.dtype == dt
            if not ok:
                fails += 1
                log("FAIL", dt, wdt, H, rows, errs)
    # non-contiguous x and dy; leading shape; zero rows; determinism; needs_input_grad.
    xb = torch.randn(64, 3, 2 * 768, device="cuda", dtype=torch.bfloat16)[..., ::2]
    xb.requires_grad_()
    w = torch.randn(768, device="cuda", requires_grad=True)
    y = RMSNormFunction.apply(xb, w, 1e-5)
    g = torch.randn(768, 3, 64, device="cuda", dtype=torch.bfloat16).permute(2, 1, 0)
    y.backward(g)
    xr = xb.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_()
    rms_norm_reference(xr, wr).backward(g.double())
    e = (rel(xb.grad, xr.grad), rel(w.grad, wr.grad))
    if max(e) > 1.5e-2:
        fails += 1
        log("FAIL non-contiguous", e)
    x0 = torch.randn(0, 5, 64, device="cuda", requires_grad=True)
    w0 = torch.randn(64, device="cuda", requires_grad=True)
    rms_norm(x0, w0).sum().backward()
    if w0.grad.abs().sum() != 0:
        fails += 1
    for H in (4096, 65536):
        x = torch.randn(3000 if H < 10000 else 300, H, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(H, device="cuda")
        dy = torch.randn_like(x)
        y, rstd = kernels.rms_norm_fwd(x, w, 1e-5)
        d1 = kernels.rms_norm_bwd(dy, x, w, rstd)[1]
        d2 = kernels.rms_norm_bwd(dy, x, w, rstd)[1]
        if not torch.equal(d1, d2):
            fails += 1
            log("FAIL determinism", H)
        dx_only = kernels.rms_norm_bwd(dy, x, w, rstd, needs_dw=False)
        if dx_only[1] is not None:
            fails += 1
    # torch.compile fullgraph over a small model using RMSNorm.
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), RMSNorm(512)).cuda()
    cmodel = torch.compile(model, fullgraph=True)
    x = torch.randn(8, 16, 512, device="cuda", requires_grad=True)
    out = cmodel(x)
    out.square().sum().backward()
    gc = [p.grad.clone() for p in model.parameters()]
    ref_out = model(x)
    model.zero_grad()
    ref_out.square().sum().backward()
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
    x = torch.randn(rows, H, device="cuda", dtype=dt)
    w = (1 + 0.1 * torch.randn(H, device="cuda")).to(dt)
    dy = torch.randn(rows, H, device="cuda", dtype=dt)
    return x, w, dy


def tune(bw):
    """Fused fwd / bwd launch configs per (dtype, H): print the best few."""
    for (name, dt), H in itertools.product(DTYPES.items(), HS):
        x, w, dy = make(ROWS, H, dt)
        es = x.element_size()
        nbytes_f, nbytes_b = 2 * ROWS * H * es, 3 * ROWS * H * es
        _, rstd = kernels.rms_norm_fwd(x, w, 1e-5)
        res = []
        if out_of_time():
            log("out of time")
            return
        for br, nw, per_sm in itertools.product((1, 2, 4, 8, 16), (4, 8, 16), (0, 2, 4, 8)):
            if br * H > 16384 or br * H < 1024 or (br * H * es) // (nw * 32) < 4:
                continue
            if per_sm * nw > 64:
                continue
            cfg = {"block_r": br, "num_warps": nw, "programs_per_sm": per_sm}
            ms = bench(lambda cfg=cfg, x=x, w=w: kernels.rms_norm_fwd(x, w, 1e-5, config=cfg),
                       rep=40)
            res.append((nbytes_f / ms / 1e6 / bw * 100, cfg))
        res.sort(key=lambda r: -r[0])
        log(f"TUNE fwd {name} {H}: " + "; ".join(f"{p:.1f}% {c}" for p, c in res[:4]))
        res = []
        for br, nw, per_sm in itertools.product((1, 2, 4, 8, 16), (4, 8, 16), (1, 2, 3, 4)):
            ept = (br * H) // (nw * 32)  # elements of each tile per thread
            if br * H * es > 32768 or ept < 4 or ept > 64 or nw * per_sm > 64:
                continue
            cfg = {"block_r": br, "num_warps": nw, "programs_per_sm": per_sm}
            ms = bench(lambda cfg=cfg, x=x, w=w, dy=dy, r=rstd:
                       kernels.rms_norm_bwd(dy, x, w, r, config=cfg), rep=40)
            res.append((nbytes_b / ms / 1e6 / bw * 100, cfg))
        res.sort(key=lambda r: -r[0])
        log(f"TUNE bwd {name} {H}: " + "; ".join(f"{p:.1f}% {c}" for p, c in res[:4]))


def tune_large(bw):
    dt = torch.bfloat16
    for H in LARGE_HS:
        if out_of_time():
            log("out of time")
            return
        x, w, dy = make(LARGE_ROWS, H, dt)
        nbytes_f, nbytes_b = 2 * x.numel() * 2, 3 * x.numel() * 2
        _, rstd = kernels.rms_norm_fwd(x, w, 1e-5)
        res = []
        cfgs = [{"looped": True, "chunk": c, "programs_per_sm": p, "num_warps": nw}
                for c, p, nw in itertools.product((4096, 8192), (1, 2, 4), (8, 16))]
        if H <= 32768:
            cfgs += [{"looped": False, "block_r": 1, "num_warps": nw, "programs_per_sm": p}
                     for nw, p in itertools.product((16, 32), (0, 1, 2))]
        for cfg in cfgs:
            ms = bench(lambda cfg=cfg, x=x, w=w: kernels.rms_norm_fwd(x, w, 1e-5, config=cfg),
                       rep=40)
            res.append((nbytes_f / ms / 1e6 / bw * 100, cfg))
        res.sort(key=lambda r: -r[0])
        log(f"TUNE fwd bf16 {H}: " + "; ".join(f"{p:.1f}% {c}" for p, c in res[:4]))
        res = []
        cfgs = [{"looped": True, "chunk": c, "programs_per_sm": p, "num_warps": nw}
                for c, p, nw in itertools.product((2048, 4096), (4, 8), (4, 8))]
        if H <= 32768:
            cfgs += [{"looped": False, "block_r": 1, "num_warps": nw, "programs_per_sm": p}
                     for nw, p in itertools.product((16, 32), (1, 2))]
        for cfg in cfgs:
            ms = bench(lambda cfg=cfg, x=x, w=w, dy=dy, r=rstd:
                       kernels.rms_norm_bwd(dy, x, w, r, config=cfg), rep=40)
            res.append((nbytes_b / ms / 1e6 / bw * 100, cfg))
        res.sort(key=lambda r: -r[0])
        log(f"TUNE bwd bf16 {H}: " + "; ".join(f"{p:.1f}% {c}" for p, c in res[:4]))


def table(bw, baselines, large):
    from tritonnorm.ops.custom_ops import rms_norm_triton

    impls = {"tritonnorm": rms_norm, "tritonnorm(op)": lambda x, w: rms_norm_triton(x, w, 1e-5)}
    # Per-call overhead floor: a one-row input, where launch and Python costs are all there is.
    x, w, dy = make(1, 1024, torch.bfloat16)
    for iname, fn in impls.items():
        f, fb = time_impl(fn, x, w, dy)
        log(f"overhead floor {iname}: fwd {f * 1e3:.1f} us, fwd+bwd {fb * 1e3:.1f} us")
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


def main():
    p = argparse.ArgumentParser()
    for flag in ("check", "tune", "tune_large", "table", "large", "baselines"):
        p.add_argument("--" + flag.replace("_", "-"), action="store_true")
    p.add_argument("--budget-s", type=float, default=float("inf"))
    a = p.parse_args()
    t0 = time.time()
    DEADLINE[0] = t0 + a.budget_s
    log(torch.cuda.get_device_name(), tritonnorm.__version__)
    fails = check() if a.check else 0
    bw = copy_bandwidth()
    log(f"copy bandwidth (read+write): {bw:.0f} GB/s  [{time.time() - t0:.0f}s]")
    if a.tune:
        tune(bw)
        log(f"[{time.time() - t0:.0f}s]")
    if a.tune_large:
        tune_large(bw)
        log(f"[{time.time() - t0:.0f}s]")
    if a.table:
        table(bw, a.baselines, a.large)
    log(f"copy bandwidth (read+write): {bw:.0f} GB/s; total {time.time() - t0:.0f}s")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
