"""Every way of sharding the trainer knows, side by side in one launch of N local ranks:
memory, bytes sent and step time.

    python apps/trainer/benchmarks/zero.py --quick
    python apps/trainer/benchmarks/zero.py --device cpu --world-size 2 --preset small \\
        --context-length 64 --batch-size 1 --rounds 3

Variants (``harness.SHARDINGS``), each set up by the trainer's ``parallelize``: ``adamw``
(PyTorch DDP + unsharded AdamW), ``zero1`` / ``zero2`` (``zero1.ShardedOptimizer`` stage 1 /
2), ``zero1-allreduce`` (PyTorch DDP, then ``ShardedOptimizer`` broadcasts its shards),
``torch_zero`` (PyTorch DDP + ``ZeroRedundancyOptimizer``), ``zero3`` / ``zero3-keep``
(``zero1.shard_model`` + ``Stage3Optimizer``) and ``fsdp`` / ``fsdp-keep`` (FSDP2), each with
``reshard_after_forward`` True / False. ``NAME#2`` measures NAME again under its own label,
in the same rounds: the A/A control that says how much of a ratio is noise.

On each variant's first step: the peak of set-up, of forward+backward and of the step
(``lab2bench.peak_memory``; on the CPU the sampled resident set, whose ``*_increase_MiB`` is
the figure to read), and the gradient and optimizer-state bytes each rank holds after
backward and after the step, counted from the tensors. The bytes each rank sends in a step
are counted from the collectives' sizes (``lab2bench.comm.count_collectives``) on one more
step of a fresh copy (PyTorch DDP's all-reduces run in C++: that copy sends them through
PyTorch's Python all-reduce hook, which issues the same calls).
"""

from __future__ import annotations

from typing import Any

import harness

MIB = harness.MIB
COLUMNS = ["preset", "variant", "sent_per_step_MiB", "sent_vs_params", "grad_MiB",
           "optim_state_MiB", "held_vs_adamw", "before_step_peak_MiB", "after_step_peak_MiB",
           "step_ms", "step_std_ms", "step_median_ms", "optimizer_ms", "ratio_to_torch_zero",
           "ratio_to_fsdp"]


def build(name: str, base, device):
    sharding, ddp, reshard = harness.SHARDINGS[harness.kind_of(name)]
    return harness.setup(harness.fresh_copy(base, device), sharding, device, ddp=ddp,
                         reshard=reshard)


def held(v) -> dict[str, int]:
    parts = harness.held_bytes(v.model, v.optimizer)
    return {"grad_bytes": parts["grad_bytes"], "optim_state_bytes": parts["optim_state_bytes"]}


def zero_rank(rank: int, world_size: int, spec: harness.RankSpec) -> dict[str, Any]:
    from lab2_trainer.training.step import backward_thread as backward_on
    from lab2bench import peak_memory
    from lab2bench.comm import count_collectives

    device = harness.rank_device()
    base = harness.base_model(spec)
    batches = harness.rank_batches(base, spec, rank, device)
    setup_mem: dict[str, Any] = {}

    def build_measured(name: str):
        with peak_memory(device) as mem:
            v = build(name, base, device)
        setup_mem[name] = mem.to_dict()
        return v

    def first_step(name: str, v) -> dict[str, Any]:
        # A step split at the optimizer, so that each part gets its own peak.
        idx, tgt = batches[0]
        v.optimizer.zero_grad(set_to_none=True)
        with peak_memory(device) as before:
            with harness.autocast(spec.precision, device):
                loss = v(idx, tgt)[1]
            with backward_on(spec.backward_thread):
                loss.backward()
            v.finish()
            del loss
        after_backward = held(v)
        with peak_memory(device) as after:
            v.optimizer.step()
        return {"before_step": before.to_dict(), "after_step": after.to_dict(),
                "after_backward_held": after_backward, "after_step_held": held(v)}

    results = harness.measure_variants(rank, spec, build_measured, batches,
                                       on_first_step=first_step)
    for name in spec.variants:
        v = build(name, base, device)
        wrapper = v.wrapper
        if hasattr(wrapper, "register_comm_hook"):
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            wrapper.register_comm_hook(None, allreduce_hook)
        # A steady step: the first one learns the bucket order (minddp's, zero1's) and may
        # lay the buckets out again, which sends more once.
        harness.step_marks(v, batches[0], spec.precision, device, spec.backward_thread)
        with count_collectives() as counter:
            harness.step_marks(v, batches[0], spec.precision, device, spec.backward_thread)
        results[name].update(setup=setup_mem[name], sent={
            "bytes": counter.volume_bytes, "calls": len(counter.calls),
            "by_kind": counter.by_kind()})
    results["params"] = sum(p.numel() for p in base.parameters())
    results["param_bytes"] = sum(p.numel() * p.element_size() for p in base.parameters())
    return results


def add_rows(out: harness.Output, args, preset: str, per_rank: list[dict[str, Any]]) -> None:
    names = list(args.variants)
    summary = {n: harness.summarize(per_rank, n) for n in names}

    def held_sum(name: str, when: str) -> list[int]:
        return [sum(r[name]["first_step"][when].values()) for r in per_rank]

    def most(name: str, when: str, part: str) -> int:
        return max(r[name]["first_step"][when][part] for r in per_rank)

    ref_ms = summary["torch_zero"]["step_ms"] if "torch_zero" in summary else None
    fsdp_ms = summary["fsdp"]["step_ms"] if "fsdp" in summary else None
    adamw_held = max(held_sum("adamw", "after_step_held")) if "adamw" in names else None
    r0 = per_rank[0]
    for name in names:
        fs, sent = r0[name]["first_step"], max(r[name]["sent"]["bytes"] for r in per_rank)
        mem = {f"{region}_{kind}_MiB": src[f"{kind}_bytes"] / MIB
               for region, src in (("setup", r0[name]["setup"]), ("before_step",
                                   fs["before_step"]), ("after_step", fs["after_step"]))
               for kind in ("peak", "increase")}
        out.add({"preset": preset, "params_M": r0["params"] / 1e6, "variant": name,
                 **harness.labels(args)},
                {"sent_per_step_MiB": sent / MIB,
                 "sent_bytes_per_rank": [r[name]["sent"]["bytes"] for r in per_rank],
                 "sent_by_kind": r0[name]["sent"]["by_kind"],
                 "collective_calls": r0[name]["sent"]["calls"],
                 "sent_vs_params": sent / r0["param_bytes"],
                 "grad_MiB": max(most(name, "after_backward_held", "grad_bytes"),
                                 most(name, "after_step_held", "grad_bytes")) / MIB,
                 "optim_state_MiB": most(name, "after_step_held", "optim_state_bytes") / MIB,
                 "optim_state_bytes_per_rank": [r[name]["first_step"]["after_step_held"]
                                                ["optim_state_bytes"] for r in per_rank],
                 "held_after_backward_bytes_per_rank": held_sum(name, "after_backward_held"),
                 "held_after_step_bytes_per_rank": held_sum(name, "after_step_held"),
                 "held_vs_adamw": (max(held_sum(name, "after_step_held")) / adamw_held
                                   if adamw_held else None),
                 **mem, "memory_source": fs["after_step"]["source"], **summary[name],
                 "ratio_to_torch_zero": summary[name]["step_ms"] / ref_ms if ref_ms else None,
                 "ratio_to_fsdp": summary[name]["step_ms"] / fsdp_ms if fsdp_ms else None})


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__.split("\n\n")[0], ranks=True)
    p.add_argument("--variants", type=harness.split, default=list(harness.SHARDINGS),
                   help=f"comma-separated, from {', '.join(harness.SHARDINGS)}")
    args = harness.parse(p, argv)
    harness.check_names(p, "variant", args.variants, harness.SHARDINGS)
    args.warmup = max(1, args.warmup)  # the first step of each variant measures memory
    out = harness.Output("zero", args.out)
    for preset in args.presets:
        spec = harness.rank_spec(args, preset, list(args.variants))
        add_rows(out, args, preset, harness.launch(zero_rank, args, spec))
    columns = COLUMNS
    if not args.device.startswith("cuda"):  # a resident set: read its growth
        columns = [c.replace("_peak_MiB", "_increase_MiB") for c in COLUMNS]
    out.table(columns, harness.title("zero", args) + "; memory of the rank holding most")
    out.note("`sent_per_step_MiB`: bytes one rank sends in a step, counted as the ZeRO paper "
             "counts them (all-reduce 2x its size, reduce-scatter and all-gather 1x); "
             "`sent_vs_params` divides it by the parameters' bytes. `grad_MiB` and "
             "`optim_state_MiB`: what the rank holding most keeps after backward and after "
             "the step; `held_vs_adamw`: their sum over DDP + AdamW's. Peaks are rank 0's.")
    out.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
