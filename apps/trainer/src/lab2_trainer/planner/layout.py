"""Recommend a layout: which (dp, tp) split, sharding kind, activation checkpointing and
gradient accumulation run a model's global batch fastest on a number of GPUs, from the
planner's predictions (:func:`lab2_trainer.planner.plan.plan`); no torch.

Every candidate keeps the model, the global batch, the GPUs, the precision and the
compilation of the plan it starts from, and varies:

* ``tp``: every divisor of ``gpus_per_node`` that divides the heads, the feed-forward width
  and the vocabulary (a tensor-parallel group stays in a node), with and without sequence
  parallelism; 1 alone with ``--precision fp8``;
* the sharding kind over the dp ranks: none, zero1, zero2, zero3, fsdp (the kinds with a
  DDP wrapper, ``zero1-allreduce`` and ``torch``, move more bytes than zero1 for the same
  memory);
* activation checkpointing: none, selective, full;
* gradient accumulation: the fewest micro-batches (a power of two dividing the batch) with
  which the plan fits.

The candidate with the shortest predicted step wins; a tie goes to the smaller peak. The
answer is as good as the predictions under it, which multi-GPU runs have not yet checked
for ``tp`` > 1.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lab2_trainer.config import ACTIVATION_CHECKPOINTING
from lab2_trainer.planner.plan import PlanInput, plan
from lab2_trainer.recipe.layout import tp_shape_problem
from lab2_trainer.recipe.muon import muon_problem

#: The sharding kinds a recommendation weighs (see the module docstring).
KINDS = ("none", "zero1", "zero2", "zero3", "fsdp")


def tp_choices(p: PlanInput) -> list[int]:
    """Tensor-parallel sizes that a plan of ``p``'s model and machine can take (1 alone with
    fp8, whose float8 products the tensor-parallel layers do not run)."""
    largest = 1 if p.precision == "fp8" else p.gpus_per_node
    return [t for t in range(1, largest + 1)
            if p.gpus_per_node % t == 0 and tp_shape_problem(p.model, t, False) is None
            and p.batch_size % (p.world_size // t) == 0]


def _fitting(p: PlanInput) -> dict[str, Any] | None:
    """The plan of ``p`` with the fewest micro-batches that fits (None: none fits)."""
    dp = p.world_size // p.tp
    accum = 1
    while p.batch_size % (dp * accum) == 0:
        result = plan(dataclasses.replace(p, grad_accum=accum, ddp=None))
        if result["fits"]:
            return result
        accum *= 2
    return None


def candidates(p: PlanInput) -> list[dict[str, Any]]:
    """Every layout weighed (see the module docstring), each a row of plain values, the
    fastest first; rows that fit in no accumulation are left out."""
    rows = []
    for tp in tp_choices(p):
        for sp in ((False, True) if tp > 1 else (False,)):
            if sp and p.model.context_length % tp:
                continue
            for kind in KINDS:
                if muon_problem(p.optimizer, kind, tp) is not None:
                    continue  # Muon's matrices must stay whole
                for ac in ACTIVATION_CHECKPOINTING:
                    q = dataclasses.replace(p, tp=tp, sequence_parallel=sp, sharding=kind,
                                            ddp=None, activation_checkpointing=ac)
                    result = _fitting(q)
                    if result is None:
                        continue
                    t = result["time"]
                    rows.append({
                        "tp": tp, "dp": result["dp"], "sequence_parallel": sp,
                        "sharding": kind, "activation_checkpointing": ac,
                        "grad_accum": result["grad_accum"],
                        "micro_batch": result["micro_batch"],
                        "peak_gib": result["peak_gib"], "step_s": t["step_s"],
                        "tokens_per_s": t["tokens_per_s"], "mfu": t["mfu"],
                        "exposed_communication_s": t["exposed_communication_s"],
                        "compute_s": t["compute_s"],
                    })
    rows.sort(key=lambda r: (r["step_s"], r["peak_gib"]))
    return rows


def describe(row: dict[str, Any]) -> str:
    """A layout in flags: ``--tp 2 --sequence-parallel --sharding zero1 ...``."""
    flags = [f"--tp {row['tp']}"] + (["--sequence-parallel"] if row["sequence_parallel"]
                                     else [])
    flags += [f"--sharding {row['sharding']}",
              f"--activation-checkpointing {row['activation_checkpointing']}",
              f"--grad-accum {row['grad_accum']}"]
    return " ".join(flags)


def recommend(p: PlanInput) -> dict[str, Any]:
    """The fastest layout that fits, why, and the best of each tensor-parallel size.

    Returns:
        ``best`` (a row of :func:`candidates`, or None when nothing fits), ``flags``,
        ``why`` (sentences comparing it with the best layout without tensor parallelism
        and with the best pure ZeRO-3 one), ``by_tp`` (the fastest row of each ``tp`` and
        sequence-parallel choice) and ``rows`` (all of them).
    """
    rows = candidates(p)
    if not rows:
        return {"best": None, "flags": None, "rows": [], "by_tp": [],
                "why": ["no layout fits: more GPUs, a smaller micro-batch than one sequence "
                        "per rank, or a smaller model"]}
    best = rows[0]
    by_tp: dict[tuple[int, bool], dict[str, Any]] = {}
    for r in rows:
        by_tp.setdefault((r["tp"], r["sequence_parallel"]), r)
    why = [f"predicted {best['step_s'] * 1e3:,.0f} ms a step ({best['tokens_per_s']:,.0f} "
           f"tokens/s, MFU {best['mfu']:.1%}) at {best['peak_gib']:,.1f} GiB a GPU, "
           f"{best['exposed_communication_s'] * 1e3:,.0f} ms of it exposed communication"]
    for label, pick in (("without tensor parallelism", lambda r: r["tp"] == 1),
                        ("as pure ZeRO-3", lambda r: r["tp"] == 1 and r["sharding"] == "zero3")):
        other = next((r for r in rows if pick(r)), None)
        if other is None:
            why.append(f"nothing fits {label}")
        elif other is not best:
            why.append(f"the best {label} ({describe(other)}) is predicted at "
                       f"{other['step_s'] * 1e3:,.0f} ms ({other['step_s'] / best['step_s']:.2f}x"
                       f") and {other['peak_gib']:,.1f} GiB")
    return {"best": best, "flags": describe(best), "why": why,
            "by_tp": list(by_tp.values()), "rows": rows}
