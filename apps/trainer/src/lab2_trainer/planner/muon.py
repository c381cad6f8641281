"""Muon's part of a step in the plan (``--optimizer muon``): the Newton-Schulz iterations of
the matrices each rank steps, and the all-to-alls that bring the matrices whole to their
owners and the new values back. Arithmetic on the model's shape; no torch.

**What each rank steps.** Muon steps the blocks' matrices, each whole (``qkv``, ``proj``,
``w1``, ``w2`` and SwiGLU's ``w3``: :func:`muon_matrices`); the tables, the head and the
vectors go to AdamW, which the planner does not time (an elementwise step, as AdamW's
alone). Under ``none`` and the DDP wrappers every rank steps every matrix. Under zero1's
stages (``zero1``, ``zero2``, ``zero3``) and the broadcasting kinds (``zero1-allreduce``,
``torch``) each matrix is stepped on one owner rank, assigned largest first onto the
least-loaded rank by elements, ties to the earlier matrix and the lower rank
(:func:`owners`: ``zero1.exchange.partition_parameters``, the rule of zero1's whole
parameters and of its broadcast path; PyTorch's ZeroRedundancyOptimizer applies the same
greedy rule to Muon's one group). Muon's optimizer balances its matrices alone, apart from
AdamW's. The balance is by elements and the iteration's cost is not (it grows as ``m²n``),
so the step waits for the rank with the most FLOPs: :attr:`MuonStep.flops`.

**The arithmetic** (:func:`newton_schulz_flops`): zero1's ``newton_schulz`` iterates on the
wide orientation, ``m ≤ n``, in bfloat16 on a GPU (``parallel.optimizers.muon_ns_dtype``,
whatever ``--precision``), so the planner counts it at ``--efficiency`` of the bf16
``--peak-tflops``, as the model's products.

**The exchanges** (zero1's stages only; :mod:`zero1.whole_params`). The averaged gradients
(and under stage 3 the values) lie in flat shards, so a step sends every owner the pieces
of its matrices that other ranks hold, in one ``all_to_all_single`` (the gradients; stage
3 the gradients and the values), and after the owners' iterations sends every holder the
new values of its pieces in another. A matrix's place in the shards has nothing to do with
its owner: (N-1)/N of it lies in other ranks' shards (exactly so where each matrix fills
its own bucket, as every xl matrix does at the default 25 MB: none fits beside another).
The owner with the most elements, ``L``, receives ``(N-1)/N`` of its ``4 L`` bytes per
tensor moved in and sends as much back; no rank sends or receives more, and the collective
ends for all when it ends for that rank. So each exchange is counted as ``4 k L`` bytes,
``(N-1)/N`` of them on the link (``k`` tensors of fp32), exposed: they run in the step,
after the backward. The broadcasting kinds move nothing that AdamW's run does not: their
broadcast carries every parameter either way.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: Newton-Schulz iterations a step: ``zero1.Muon``'s ``ns_steps`` default, which the
#: trainer keeps.
NS_STEPS = 5
#: The sharding kinds that step each Muon matrix on one owner rank.
OWNER_KINDS = ("zero1", "zero2", "zero3", "zero1-allreduce", "torch")
#: Tensors each of zero1's stages moves to the owners and back per matrix: stages 1 and 2
#: the averaged gradient in and the values out; stage 3 the gradient and the values in.
EXCHANGED = {"zero1": (1, 1), "zero2": (1, 1), "zero3": (2, 1)}
#: Bytes of an exchanged element: the trainer's weights and gradients are fp32.
ELEMENT_BYTES = 4


def muon_matrices(config: Any) -> list[tuple[int, int]]:
    """(rows, cols) of every matrix ``--optimizer muon`` steps with Muon, in its optimizer's
    order (``parallel.optimizers.muon_param_groups``: the blocks' ``nn.Linear`` weights as
    registered): per block ``qkv``, ``proj``, ``w1``, ``w2`` and SwiGLU's ``w3``."""
    d, f = config.d_model, config.d_ff
    block = [(3 * d, d), (d, d), (f, d), (d, f)] + ([(f, d)] if config.ffn == "swiglu" else [])
    return block * config.n_layers


def newton_schulz_flops(rows: int, cols: int, steps: int = NS_STEPS) -> float:
    """FLOPs of ``steps`` Newton-Schulz iterations of a ``rows x cols`` matrix, as
    ``zero1.newton_schulz`` runs them (a multiply-add is two FLOPs).

    The iteration runs on the wide orientation, ``X`` of ``m x n`` with ``m = min(rows,
    cols) ≤ n`` (a tall matrix is transposed first). Each iteration is three products:

    * ``A = X Xᵀ`` (m x n by n x m): ``m·m·n`` multiply-adds, ``2 m² n`` FLOPs;
    * ``bA + c A·A`` (one ``addmm``, m x m by m x m): ``m·m·m``, ``2 m³``;
    * ``aX + (bA + cA²) X`` (one ``addmm``, m x m by m x n): ``m·m·n``, ``2 m² n``;

    so ``4 m² n + 2 m³`` an iteration. The elementwise parts (the ``addmm``'s scalings and
    sums, ``O(m²)`` and ``O(mn)``, and the normalisation before the first iteration) are
    left out: under ``1/m`` of the products. A stack of equal shapes (zero1 iterates them
    in batched products) costs the same per matrix.
    """
    m, n = min(rows, cols), max(rows, cols)
    return float(steps * (4 * m * m * n + 2 * m * m * m))


def owners(sizes: Sequence[int], ranks: int) -> tuple[list[int], list[int]]:
    """(owner of each matrix, elements each rank owns): largest first onto the least-loaded
    rank, ties to the earlier matrix and to the lower rank (``zero1.exchange``'s
    ``partition_parameters`` from zero loads)."""
    loads = [0] * ranks
    heap = [(0, rank) for rank in range(ranks)]
    out = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, rank = heapq.heappop(heap)
        out[index] = rank
        loads[rank] = load + sizes[index]
        heapq.heappush(heap, (loads[rank], rank))
    return out, loads


@dataclass(frozen=True)
class MuonStep:
    """What Muon adds to one rank's step.

    Attributes:
        matrices: the matrices Muon steps (all ranks together).
        owners: each matrix's owner rank, or None where every rank steps every matrix.
        flops: Newton-Schulz FLOPs of the rank with the most (all of them without owners).
        elements: elements of the matrices that rank owns (all of them without owners).
        largest_owned: elements of the largest load any rank owns (the exchanges' ``L``).
        exchanges: ``(name, bytes, tensors)`` of each all-to-all a step, in order.
    """

    matrices: int
    owners: list[int] | None
    flops: float
    elements: int
    largest_owned: int
    exchanges: tuple[tuple[str, float, int], ...]


def muon_step(config: Any, sharding: str, dp: int) -> MuonStep:
    """Muon's iterations and exchanges on one of ``dp`` data-parallel ranks under
    ``sharding`` (see the module docstring)."""
    shapes = muon_matrices(config)
    flops = [newton_schulz_flops(r, c) for r, c in shapes]
    sizes = [r * c for r, c in shapes]
    if sharding not in OWNER_KINDS or dp == 1:
        return MuonStep(len(shapes), None, sum(flops), sum(sizes), sum(sizes), ())
    owner, loads = owners(sizes, dp)
    per_rank = [0.0] * dp
    for f, r in zip(flops, owner):
        per_rank[r] += f
    slowest = max(range(dp), key=lambda r: (per_rank[r], -r))
    largest = max(loads)
    exchanges: tuple[tuple[str, float, int], ...] = ()
    if sharding in EXCHANGED:
        into, back = EXCHANGED[sharding]
        inbound = "gradients and values" if into == 2 else "gradients"
        exchanges = ((f"Muon's {inbound} to owners", ELEMENT_BYTES * into * largest, into),
                     ("Muon's new values from owners", ELEMENT_BYTES * back * largest, back))
    return MuonStep(len(shapes), owner, per_rank[slowest], loads[slowest], largest, exchanges)
