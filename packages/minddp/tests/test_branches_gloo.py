"""Rank-dependent graphs, skipped backward passes and no_sync accumulation.

Each rank takes another path through ``BranchyNet``, so which parameters get
gradients, and the order their hooks fire in, differs between ranks. The oracle
is single-process training on the sum of every rank's loss.
"""

from __future__ import annotations

import torch

from lab2_testing import ddp_testkit as kit
from lab2_testing import rank_programs as programs
from lab2_testing import run_ranks


def _reference(world_size: int, scenario: str) -> dict:
    model = kit.build_model("branchy", programs.BRANCH_SEED)
    optimizer = kit.make_optimizer(model)
    per = programs.BRANCH_BATCH // world_size
    batches = kit.make_batches(
        "branchy", programs.BRANCH_SEED, programs.BRANCH_STEPS, programs.BRANCH_BATCH
    )
    for step, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        loss = torch.zeros((), dtype=kit.DTYPE)
        for rank in range(world_size):
            start, end = rank * per, (rank + 1) * per
            even = rank % 2 == 0
            if scenario == "branches":
                if not programs.skips_backward(rank, world_size, step):
                    out = model(x[start:end], even)
                    loss = loss + kit.summed_loss("branchy", out, y[start:end])
            else:
                (a, b), (c, d) = programs.halves(start, end)
                loss = loss + kit.summed_loss("branchy", model(x[a:b], even), y[a:b])
                loss = loss + kit.summed_loss("branchy", model(x[c:d], not even), y[c:d])
        (loss / programs.BRANCH_BATCH).backward()
        optimizer.step()
    return kit.snapshot(model)


def test_rank_dependent_graphs_and_no_sync_match_single_process(world_size):
    results = run_ranks(programs.branches_rank, world_size, timeout=120)
    want = {s: _reference(world_size, s) for s in ("branches", "no_sync")}
    # The parameter no rank uses keeps grad None; with one rank, 'right' is unused too.
    assert want["branches"]["grad_is_none"]["never.weight"]
    assert want["branches"]["grad_is_none"]["right.weight"] == (world_size == 1)
    for rank, per_rank in enumerate(results):
        assert len(per_rank) == len(kit.VARIANTS) + len(programs.OVERLAPPING)
        for (scenario, variant), got in per_rank.items():
            label = f"{scenario}/{variant} rank {rank}/{world_size}"
            kit.assert_matches(got, want[scenario], label)
