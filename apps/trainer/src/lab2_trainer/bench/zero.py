"""Suite ``zero``: optimizer-state sharding, ours against PyTorch's, and unsharded AdamW.

Variants (one launch of N ranks, same model, data and seed; gradients averaged by PyTorch's
DistributedDataParallel in every variant, so only the optimizer differs). Each is set up by
the trainer's own code: ``GradSync`` ("torch") and ``build_optimizer`` with the sharding in
brackets, the trainer's AdamW (decay and no-decay groups, fused kernels on CUDA):
    adamw       [none] unsharded ``torch.optim.AdamW`` on every rank.
    sharded     [zero1] ``zero1.ShardedOptimizer(groups, AdamW)``.
    torch_zero  [torch] ``torch.distributed.optim.ZeroRedundancyOptimizer(groups, AdamW)``.

Memory, the course handout's three points, measured on each variant's first step:
peak of model setup (copy to the device, DDP, optimizer), peak of forward+backward (up to
just before ``optimizer.step()``), and peak of the step itself, with ``lab2bench.peak_memory``
(CUDA allocator; sampled resident set on the CPU, where ``*_increase_MiB`` is the meaningful
figure). The breakdown (parameters, gradients, optimizer state per rank) is counted exactly
from the tensors. Timing: full training step and ``optimizer.step()`` alone, timed steps after
the warm-up, interleaved rounds.
"""

from __future__ import annotations

import argparse
from typing import Any

from lab2_trainer.backward_thread import backward_thread as backward_on
from lab2_trainer.bench.arguments import ZERO_VARIANTS
from lab2_trainer.bench.distributed import (
    RankSpec,
    Variant,
    base_model,
    fresh_copy,
    launch,
    make_variant,
    measure_variants,
    rank_batches,
    rank_device,
    rank_spec,
    summarize,
    thread_label,
    timing_label,
)
from lab2_trainer.bench.workload import tensor_breakdown
from lab2bench.suites import SuiteOutput

MIB = 2**20
#: Each variant's optimizer sharding, as the trainer's ``--sharding`` names it.
SHARDING = {"adamw": "none", "sharded": "zero1-allreduce", "torch_zero": "torch"}
COLUMNS = ["preset", "variant", "optim_state_MiB", "state_vs_total_over_n", "param_MiB",
           "grad_MiB", "setup_peak_MiB", "before_step_peak_MiB", "after_step_peak_MiB",
           "step_ms", "step_std_ms", "optimizer_ms", "ratio_to_torch_zero"]


def run(args: argparse.Namespace, out: SuiteOutput) -> None:
    bad = [k for k in args.variants if k not in ZERO_VARIANTS]
    if bad:
        raise SystemExit(f"lab2-train bench zero: unknown variant(s) {', '.join(bad)}")
    # The first step of each variant measures memory and is never timed.
    args.warmup = max(1, args.warmup)
    for preset in args.presets:
        spec = rank_spec(args, preset, list(args.variants))
        per_rank = launch(zero_rank, args, spec)
        add_rows(out, args, preset, per_rank)
    columns = COLUMNS
    if not args.device.startswith("cuda"):
        # A resident set includes the interpreter and allocator slack: on the CPU the
        # growth during each region is the figure to read.
        columns = [c.replace("_peak_MiB", "_increase_MiB") for c in COLUMNS]
    out.table(columns, title=f"zero: {args.world_size} ranks, {args.device}, {args.precision}, "
                             f"batch {args.batch_size}/rank x context {args.context_length}; "
                             f"steps timed {timing_label(args)}, {thread_label(args)}; memory "
                             "of rank 0 (state ratio: worst rank)")
    out.note(
        "Memory is of each variant's first step on rank 0 (peaks from lab2bench.peak_memory: "
        "CUDA allocator, or sampled RSS on the CPU where the *_increase figures in the JSONL "
        "are the meaningful ones); `optim_state_MiB` is counted from the optimizer's state "
        "tensors; `state_vs_total_over_n` = the largest rank's state bytes / (unsharded AdamW "
        "state bytes / N). Step time = slowest rank per step, mean over steps and rounds."
    )


def zero_rank(rank: int, world_size: int, spec: RankSpec) -> dict[str, Any]:
    """One rank of the ``zero`` suite."""
    from lab2bench import peak_memory

    device = rank_device()
    base = base_model(spec)
    batches = rank_batches(base, spec, rank, device)
    setup_mem: dict[str, Any] = {}

    def build(name: str) -> Variant:
        with peak_memory(device) as mem:
            v = make_variant(fresh_copy(base, device), "torch", SHARDING[name], device)
        setup_mem[name] = {"setup": mem.to_dict(),
                           "after_setup": tensor_breakdown(v.model, v.optimizer)}
        return v

    def first_step(name: str, v: Variant) -> dict[str, Any]:
        # The same step as run_step, split at the optimizer so each part gets its own peak.
        from lab2_trainer.bench.workload import autocast

        idx, tgt = batches[0]
        v.optimizer.zero_grad(set_to_none=True)
        with peak_memory(device) as before:
            with autocast(spec.precision, device):
                _, loss = v.sync(idx, tgt)
            with backward_on(spec.backward_thread):
                loss.backward()
            v.sync.finish()
            del loss
        before_parts = tensor_breakdown(v.model, v.optimizer)
        with peak_memory(device) as after:
            v.optimizer.step()
        return {"before_step": before.to_dict(), "before_step_parts": before_parts,
                "after_step": after.to_dict(),
                "after_step_parts": tensor_breakdown(v.model, v.optimizer)}

    results = measure_variants(rank, spec, build, lambda n: batches, on_first_step=first_step)
    for name in spec.variants:
        results[name].update(setup_mem[name])
    results["params"] = sum(p.numel() for p in base.parameters())
    return results


def add_rows(out: SuiteOutput, args: argparse.Namespace, preset: str,
             per_rank: list[dict[str, Any]]) -> None:
    names = list(args.variants)
    summary = {n: summarize(per_rank, n) for n in names}
    n_ranks = len(per_rank)

    def state(rank_result: dict[str, Any], name: str) -> int:
        return rank_result[name]["first_step"]["after_step_parts"]["optim_state_bytes"]

    # The unsharded total: AdamW's state on one rank when it ran, else the sum over ranks of
    # a sharded variant's (each parameter's state lives on exactly one rank).
    if "adamw" in names:
        total = state(per_rank[0], "adamw")
    else:
        total = sum(state(r, names[0]) for r in per_rank)
    ref_ms = summary["torch_zero"]["step_ms"] if "torch_zero" in summary else None
    r0 = per_rank[0]
    for name in names:
        fs = r0[name]["first_step"]
        parts = fs["after_step_parts"]
        per_rank_state = [state(r, name) for r in per_rank]
        conf = {"preset": preset, "params_M": r0["params"] / 1e6, "variant": name,
                "world_size": args.world_size, "device": args.device,
                "precision": args.precision, "batch_size": args.batch_size,
                "context_length": args.context_length, "steps": args.steps,
                "rounds": args.rounds, "timing": timing_label(args),
                "backward_thread": args.backward_thread}
        s = summary[name]
        metrics = {
            "param_MiB": parts["param_bytes"] / MIB,
            "grad_MiB": parts["grad_bytes"] / MIB,
            "optim_state_MiB": parts["optim_state_bytes"] / MIB,
            "optim_state_bytes_per_rank": per_rank_state,
            "optim_state_total_bytes": total,
            "state_vs_total_over_n": (max(per_rank_state) / (total / n_ranks)
                                      if total else None),
            "setup_peak_MiB": r0[name]["setup"]["peak_bytes"] / MIB,
            "setup_increase_MiB": r0[name]["setup"]["increase_bytes"] / MIB,
            "before_step_peak_MiB": fs["before_step"]["peak_bytes"] / MIB,
            "before_step_increase_MiB": fs["before_step"]["increase_bytes"] / MIB,
            "after_step_peak_MiB": fs["after_step"]["peak_bytes"] / MIB,
            "after_step_increase_MiB": fs["after_step"]["increase_bytes"] / MIB,
            "after_step_end_MiB": fs["after_step"]["end_bytes"] / MIB,
            "memory_source": fs["after_step"]["source"],
            **s,
            "ratio_to_torch_zero": s["step_ms"] / ref_ms if ref_ms else None,
        }
        out.add(conf, metrics)
