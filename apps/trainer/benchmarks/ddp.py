"""minddp's data-parallel variants against PyTorch's DistributedDataParallel, N local ranks.

    python apps/trainer/benchmarks/ddp.py --quick                       # 2 Gloo ranks, seconds
    python apps/trainer/benchmarks/ddp.py --device cuda --world-size 2 --precision bf16 \\
        --preset medium --variants local,bucketed,torch --bucket-mb 25

Every variant is the trainer's ``--ddp`` wrapper of that kind with the trainer's AdamW, timed
over a full step (forward, backward, gradient synchronisation, clipping, AdamW), all in one launch:
``local`` (no communication: the baseline), ``naive`` (an all-reduce per parameter after
backward), ``flat`` (one of everything), ``individual`` (``DDPIndividualParameters``),
``bucketed:MB`` (``DDPBucketed``, once per ``--bucket-mb``), ``torch`` (PyTorch DDP,
``--torch-bucket-mb``), and on request ``bucketed_bf16:MB`` / ``torch_bf16`` (gradients on the
wire in bfloat16: ``reduce_dtype`` / PyTorch's ``bf16_compress_hook``).

Exposed communication, two ways: ``sync_wait``, from the end of ``backward()`` to the end of
the synchronisation call (PyTorch DDP waits inside ``backward()``: 0 by construction), and
``overhead_vs_local``, the step time minus ``local``'s in the same run, which is comparable
across all variants. On CUDA ``--trace`` profiles one more step per variant: the share of
NCCL kernel time that ran under compute kernels (``overlap_share``) and the NCCL time under
none, over the step time (``nccl_exposed_share``).
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import harness
import torch

#: The ``--ddp`` kind of each variant; the bucketed ones run once per bucket size.
DDP_KIND = {"local": "none", "naive": "naive", "flat": "flat", "individual": "individual",
            "bucketed": "bucketed", "torch": "torch", "bucketed_bf16": "bucketed",
            "torch_bf16": "torch"}
DEFAULT_VARIANTS = "local,naive,flat,individual,bucketed,torch"
BUCKETED = ("bucketed", "bucketed_bf16")
COLUMNS = ["preset", "variant", "step_ms", "step_std_ms", "ratio_to_torch", "backward_ms",
           "sync_wait_ms", "sync_wait_share", "overhead_vs_local_ms", "exposed_share_vs_local"]


def overlap_of_events(events: list[dict[str, Any]]) -> dict[str, float] | None:
    """NCCL kernel time, compute kernel time, and the NCCL time that ran while a compute
    kernel ran ("hidden"), from Chrome-trace kernel events (µs); None without NCCL."""
    spans: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for ev in events:
        if ev.get("ph") == "X" and ev.get("cat") == "kernel":
            start = float(ev.get("ts", 0.0))
            is_nccl = "nccl" in str(ev.get("name", "")).lower()
            spans[is_nccl].append((start, start + float(ev.get("dur", 0.0))))
    if not spans[True]:
        return None
    merged = {}
    for key, items in spans.items():
        merged[key] = []
        for start, end in sorted(items):
            if merged[key] and start <= merged[key][-1][1]:
                merged[key][-1] = (merged[key][-1][0], max(merged[key][-1][1], end))
            else:
                merged[key].append((start, end))
    hidden, i, j = 0.0, 0, 0  # one walk over the two sorted, disjoint lists
    a, b = merged[True], merged[False]
    while i < len(a) and j < len(b):
        hidden += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    nccl = sum(e - s for s, e in merged[True])
    return {"nccl_ms": nccl / 1e3, "compute_ms": sum(e - s for s, e in merged[False]) / 1e3,
            "hidden_ms": hidden / 1e3, "hidden_share": hidden / nccl if nccl > 0 else 0.0}


def variant_names(p, args) -> list[str]:
    harness.check_names(p, "variant", args.variants, DDP_KIND)
    buckets = [1, 5, 10, 25, 50, 100, 500] if args.sweep else args.bucket_mb
    if any(b <= 0 for b in buckets):
        p.error("bucket sizes must be > 0")
    return [name for kind in args.variants
            for name in ([f"{kind}:{b:g}" for b in buckets] if kind in BUCKETED else [kind])]


def build_variant(name: str, base, device: torch.device, spec: harness.RankSpec):
    kind, _, mb = name.partition(":")
    return harness.setup(harness.fresh_copy(base, device), "none", device, ddp=DDP_KIND[kind],
                         bucket_mb=float(mb) if mb else spec.torch_bucket_mb,
                         reduce_dtype=torch.bfloat16 if kind.endswith("_bf16") else None,
                         bucket_rule=spec.bucket_rule)


def ddp_rank(rank: int, world_size: int, spec: harness.RankSpec) -> dict[str, Any]:
    """One rank: every variant, interleaved rounds; a traced step per variant with --trace."""
    device = harness.rank_device()
    base = harness.base_model(spec)
    batches = harness.rank_batches(base, spec, rank, device)
    overlap: dict[str, Any] = {}

    def after(name: str, v, rnd: int) -> None:
        if spec.trace and rnd == spec.rounds - 1:
            overlap[name] = traced_step(name, v, batches[0], spec, rank, device)

    results = harness.measure_variants(rank, spec, lambda n: build_variant(n, base, device, spec),
                                       batches, after_variant=after)
    return {**results, "params": sum(p.numel() for p in base.parameters()), "overlap": overlap}


def traced_step(name: str, v, batch, spec: harness.RankSpec, rank: int,
                device: torch.device) -> dict[str, float] | None:
    """Profile one step, save its Chrome trace; on CUDA return the NCCL/compute overlap."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        harness.step_marks(v, batch, spec.precision, device, spec.backward_thread)()
    folder = spec.trace_dir or tempfile.mkdtemp(prefix="lab2-bench-trace-")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{spec.preset}-{name.replace(':', '-')}-rank{rank}.json")
    prof.export_chrome_trace(path)
    if not cuda:
        return None
    with open(path) as f:
        data = json.load(f)
    return overlap_of_events(data.get("traceEvents", []) if isinstance(data, dict) else data)


def add_rows(out: harness.Output, args, preset: str, names: list[str],
             per_rank: list[dict[str, Any]]) -> None:
    summary = {name: harness.summarize(per_rank, name) for name in names}
    torch_ms = summary.get("torch", {}).get("step_ms")
    local_ms = summary.get("local", {}).get("step_ms")
    for name in names:
        s = summary[name]
        overhead = s["step_ms"] - local_ms if local_ms is not None else None
        overlap = [r["overlap"][name] for r in per_rank if r["overlap"].get(name)]
        out.add({"preset": preset, "params_M": per_rank[0]["params"] / 1e6, "variant": name,
                 "bucket_mb": float(name.split(":")[1]) if ":" in name else None,
                 **harness.labels(args), "bucket_rule": args.bucket_rule},
                {**s, "ratio_to_torch": s["step_ms"] / torch_ms if torch_ms else None,
                 "sync_wait_share": s["sync_wait_ms"] / s["step_ms"],
                 "overhead_vs_local_ms": overhead,
                 "exposed_share_vs_local": (max(0.0, overhead) / s["step_ms"]
                                            if overhead is not None else None),
                 "overlap_share": (sum(o["hidden_share"] for o in overlap) / len(overlap)
                                   if overlap else None),
                 "nccl_exposed_share": (sum(o["nccl_ms"] - o["hidden_ms"] for o in overlap)
                                        / len(overlap) / s["step_ms"] if overlap else None)})


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__.split("\n\n")[0], ranks=True)
    p.add_argument("--variants", type=harness.split, default=DEFAULT_VARIANTS.split(","),
                   help=f"comma-separated, from {', '.join(DDP_KIND)}")
    p.add_argument("--bucket-mb", type=lambda s: [float(x) for x in s.split(",")],
                   default=[1.0, 5.0, 25.0, 100.0], help="bucket sizes of the bucketed variants")
    p.add_argument("--sweep", action="store_true", help="bucket sizes 1,5,10,25,50,100,500 MB")
    p.add_argument("--bucket-rule", default="reach", choices=("reach", "at_most"))
    p.add_argument("--torch-bucket-mb", type=float, default=25.0)
    p.add_argument("--trace", action="store_true",
                   help="profile one more step per variant (Chrome traces under --out)")
    args = harness.parse(p, argv)
    names = variant_names(p, args)
    trace_dir = os.path.abspath(os.path.join(args.out, "traces")) if args.out else None
    out = harness.Output("ddp", args.out)
    for preset in args.presets:
        spec = harness.rank_spec(args, preset, names, trace_dir=trace_dir)
        add_rows(out, args, preset, names, harness.launch(ddp_rank, args, spec))
    out.table(COLUMNS + ["overlap_share", "nccl_exposed_share"] * args.trace,
              harness.title("ddp", args))
    out.note("Exposed communication: `sync_wait` = end of backward -> end of the "
             "synchronisation call, per rank, averaged; `overhead_vs_local` = step time minus "
             "that of `local` (same ranks, same run, no communication). Shares are of the "
             "variant's own step time. Step time = slowest rank per step, mean over steps "
             "and rounds.")
    out.plot("bucket-sweep", x="bucket_mb", y="step_ms", series="preset", logx=True,
             rows=[r for r in out.rows if r["bucket_mb"] is not None])
    out.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
