"""Suite ``zero``: every way of sharding the trainer knows, side by side in one launch.

Variants (``bench.arguments.SHARDINGS``; one launch of N ranks, same model, data and seed),
each set up by the trainer's own ``parallelize`` with the trainer's AdamW (decay and
no-decay groups, fused kernels on CUDA):
    adamw            PyTorch DDP + unsharded ``torch.optim.AdamW``.
    zero1, zero2     ``zero1.ShardedOptimizer`` stage 1 / 2: gradients reduce-scattered in
                     buckets during backward, parameters all-gathered after the step.
    zero1-allreduce  PyTorch DDP all-reduces, ``ShardedOptimizer`` broadcasts its shards.
    torch_zero       PyTorch DDP + ``ZeroRedundancyOptimizer``.
    fsdp, fsdp-keep  PyTorch's FSDP2 on every block and the root, ``reshard_after_forward``
                     True / False.

Memory, measured on each variant's first step: the peak of model setup, of forward+backward
(up to just before ``optimizer.step()``) and of the step itself (``lab2bench.peak_memory``:
the CUDA allocator; sampled resident set on the CPU, where ``*_increase_MiB`` is the figure
to read), and the gradient and optimizer-state bytes each rank holds after backward and
after the step, counted from the tensors (``distributed.held_bytes``). Communication: the
bytes each rank sends in one step, counted from the collectives' sizes by
``lab2bench.comm.count_collectives`` on an extra untimed step of a fresh copy (PyTorch DDP's
all-reduces run in C++, so that copy sends them through PyTorch's own Python all-reduce
hook, which issues the same calls). Timing: the full step and ``optimizer.step()`` alone,
timed steps after the warm-up, variants interleaved over rounds.
"""

from __future__ import annotations

import argparse
from typing import Any

from lab2_trainer.bench.arguments import ZERO_VARIANTS
from lab2_trainer.bench.distributed import (
    RankSpec,
    Variant,
    base_model,
    fresh_copy,
    held_bytes,
    launch,
    make_sharded_variant,
    measure_variants,
    rank_batches,
    rank_device,
    rank_spec,
    run_step,
    summarize,
    thread_label,
    timing_label,
)
from lab2bench.suites import SuiteOutput

MIB = 2**20
COLUMNS = ["preset", "variant", "sent_per_step_MiB", "sent_vs_params", "grad_MiB",
           "optim_state_MiB", "held_vs_adamw", "before_step_peak_MiB", "after_step_peak_MiB",
           "step_ms", "step_std_ms", "optimizer_ms", "ratio_to_torch_zero"]


def run(args: argparse.Namespace, out: SuiteOutput) -> None:
    bad = [k for k in args.variants if k not in ZERO_VARIANTS]
    if bad:
        raise SystemExit(f"lab2-train bench zero: unknown variant(s) {', '.join(bad)} "
                         f"(from {', '.join(ZERO_VARIANTS)})")
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
                             "of the rank holding most")
    out.note(
        "`sent_per_step_MiB`: bytes one rank sends in a step, counted from the collectives "
        "as the ZeRO paper counts them (all-reduce 2x its size, reduce-scatter and all-gather "
        "1x); `sent_vs_params` divides it by the parameters' bytes (DDP: 2, ZeRO's design: 2, "
        "the all-reduce + broadcast pairing: about 3). `grad_MiB` and `optim_state_MiB`: "
        "what the rank holding most keeps after the step's backward and after its step; "
        "`held_vs_adamw`: their sum over DDP + AdamW's. Peaks are rank 0's (CUDA allocator, "
        "or the growth of the sampled RSS on the CPU). Step time = slowest rank per step, "
        "mean over steps and rounds."
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
            v = make_sharded_variant(fresh_copy(base, device), name, device)
        setup_mem[name] = mem.to_dict()
        return v

    def first_step(name: str, v: Variant) -> dict[str, Any]:
        # The step of run_step, split at the optimizer so each part gets its own peak.
        from lab2_trainer.bench.workload import autocast
        from lab2_trainer.train import backward_thread as backward_on

        idx, tgt = batches[0]
        v.optimizer.zero_grad(set_to_none=True)
        with peak_memory(device) as before:
            with autocast(spec.precision, device):
                _, loss = v.sync(idx, tgt)
            with backward_on(spec.backward_thread):
                loss.backward()
            v.sync.finish()
            del loss
        after_backward = held_bytes(v)
        with peak_memory(device) as after:
            v.optimizer.step()
        return {"before_step": before.to_dict(), "after_step": after.to_dict(),
                "after_backward_held": after_backward, "after_step_held": held_bytes(v)}

    results = measure_variants(rank, spec, build, lambda n: batches, on_first_step=first_step)
    for name in spec.variants:
        results[name]["setup"] = setup_mem[name]
        results[name]["sent"] = bytes_sent(name, base, batches[0], spec, device)
    results["params"] = sum(p.numel() for p in base.parameters())
    results["param_bytes"] = sum(p.numel() * p.element_size() for p in base.parameters())
    return results


def bytes_sent(name: str, base: Any, batch: Any, spec: RankSpec, device: Any) -> dict[str, Any]:
    """Bytes this rank sends in one step of a fresh copy of variant ``name``, by kind."""
    from lab2bench.comm import count_collectives

    v = make_sharded_variant(fresh_copy(base, device), name, device)
    wrapper = getattr(v.sync.sync, "wrapper", None)
    if wrapper is not None and hasattr(wrapper, "register_comm_hook"):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        wrapper.register_comm_hook(None, allreduce_hook)
    with count_collectives() as counter:
        run_step(v, batch, spec.precision, device, spec.backward_thread)
    return {"bytes": counter.volume_bytes, "calls": len(counter.calls),
            "by_kind": counter.by_kind()}


def add_rows(out: SuiteOutput, args: argparse.Namespace, preset: str,
             per_rank: list[dict[str, Any]]) -> None:
    names = list(args.variants)
    summary = {n: summarize(per_rank, n) for n in names}

    def held(name: str, when: str) -> list[int]:
        return [sum(r[name]["first_step"][when].values()) for r in per_rank]

    def most(name: str, when: str, part: str) -> int:
        return max(r[name]["first_step"][when][part] for r in per_rank)

    ref_ms = summary["torch_zero"]["step_ms"] if "torch_zero" in summary else None
    adamw_held = max(held("adamw", "after_step_held")) if "adamw" in names else None
    r0 = per_rank[0]
    for name in names:
        fs = r0[name]["first_step"]
        conf = {"preset": preset, "params_M": r0["params"] / 1e6, "variant": name,
                "world_size": args.world_size, "device": args.device,
                "precision": args.precision, "batch_size": args.batch_size,
                "context_length": args.context_length, "steps": args.steps,
                "rounds": args.rounds, "timing": timing_label(args),
                "backward_thread": args.backward_thread}
        sent = max(r[name]["sent"]["bytes"] for r in per_rank)
        held_after = max(held(name, "after_step_held"))
        metrics = {
            "sent_per_step_MiB": sent / MIB,
            "sent_bytes_per_rank": [r[name]["sent"]["bytes"] for r in per_rank],
            "sent_by_kind": r0[name]["sent"]["by_kind"],
            "collective_calls": r0[name]["sent"]["calls"],
            "sent_vs_params": sent / r0["param_bytes"],
            "grad_MiB": max(most(name, "after_backward_held", "grad_bytes"),
                            most(name, "after_step_held", "grad_bytes")) / MIB,
            "optim_state_MiB": most(name, "after_step_held", "optim_state_bytes") / MIB,
            "optim_state_bytes_per_rank": [r[name]["first_step"]["after_step_held"]
                                           ["optim_state_bytes"] for r in per_rank],
            "held_after_backward_bytes_per_rank": held(name, "after_backward_held"),
            "held_after_step_bytes_per_rank": held(name, "after_step_held"),
            "held_vs_adamw": held_after / adamw_held if adamw_held else None,
            "setup_peak_MiB": r0[name]["setup"]["peak_bytes"] / MIB,
            "setup_increase_MiB": r0[name]["setup"]["increase_bytes"] / MIB,
            "before_step_peak_MiB": fs["before_step"]["peak_bytes"] / MIB,
            "before_step_increase_MiB": fs["before_step"]["increase_bytes"] / MIB,
            "after_step_peak_MiB": fs["after_step"]["peak_bytes"] / MIB,
            "after_step_increase_MiB": fs["after_step"]["increase_bytes"] / MIB,
            "memory_source": fs["after_step"]["source"],
            **summary[name],
            "ratio_to_torch_zero": summary[name]["step_ms"] / ref_ms if ref_ms else None,
        }
        out.add(conf, metrics)
