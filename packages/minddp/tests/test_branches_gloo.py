"""Rank-dependent graphs, skipped backward passes and no_sync accumulation.

Each rank takes another path through ``BranchyNet``, so which parameters get
gradients, and the order their hooks fire in, differs between ranks. The oracle
is single-process training on the sum of every rank's loss.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from lab2_testing import run_ranks


def _testkit():
    # Loaded by path: pytest's importlib mode keeps this folder off sys.path.
    name = "_minddp_ddp_testkit"
    if name not in sys.modules:
        path = Path(__file__).with_name("ddp_testkit.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


kit = _testkit()

STEPS = 3
BATCH = 12
SEED = 99
OVERLAPPING = ("individual", "bucketed_tiny", "bucketed_few", "bucketed_one")


def _skips_backward(rank: int, world_size: int, step: int) -> bool:
    """The last rank sits out step 1 entirely (no forward, no backward)."""
    return world_size > 1 and rank == world_size - 1 and step == 1


def _halves(start: int, end: int) -> list[tuple[int, int]]:
    middle = start + (end - start) // 2
    return [(start, middle), (middle, end)]


def _branches_rank(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    batches = kit.make_batches("branchy", SEED, STEPS, BATCH)
    per = BATCH // world_size
    start, end = rank * per, (rank + 1) * per
    even = rank % 2 == 0
    scale = world_size / BATCH
    out: dict = {}
    for variant in kit.VARIANTS:  # branches, and a rank that skips backward
        model = kit.build_model("branchy", SEED + 1000 * rank)
        runner, sync = kit.wrap(variant, model)
        optimizer = kit.make_optimizer(model)
        for step, (x, y) in enumerate(batches):
            optimizer.zero_grad()
            if not _skips_backward(rank, world_size, step):
                out_ = runner(x[start:end], even)
                (kit.summed_loss("branchy", out_, y[start:end]) * scale).backward()
            sync()
            optimizer.step()
        out[("branches", variant)] = kit.snapshot(model)
    for variant in OVERLAPPING:  # no_sync: first half-slice local, second synced
        model = kit.build_model("branchy", SEED + 1000 * rank)
        ddp, _ = kit.wrap(variant, model)
        optimizer = kit.make_optimizer(model)
        for x, y in batches:
            optimizer.zero_grad()
            (a, b), (c, d) = _halves(start, end)
            with ddp.no_sync():
                (kit.summed_loss("branchy", ddp(x[a:b], even), y[a:b]) * scale).backward()
                ddp.finish_gradient_synchronization()  # a no-op inside no_sync
                assert not ddp._handles, "no_sync launched a collective"
            (kit.summed_loss("branchy", ddp(x[c:d], not even), y[c:d]) * scale).backward()
            ddp.finish_gradient_synchronization()
            optimizer.step()
        out[("no_sync", variant)] = kit.snapshot(model)
    return out


def _reference(world_size: int, scenario: str) -> dict:
    model = kit.build_model("branchy", SEED)
    optimizer = kit.make_optimizer(model)
    per = BATCH // world_size
    for step, (x, y) in enumerate(kit.make_batches("branchy", SEED, STEPS, BATCH)):
        optimizer.zero_grad()
        loss = torch.zeros((), dtype=kit.DTYPE)
        for rank in range(world_size):
            start, end = rank * per, (rank + 1) * per
            even = rank % 2 == 0
            if scenario == "branches":
                if not _skips_backward(rank, world_size, step):
                    out = model(x[start:end], even)
                    loss = loss + kit.summed_loss("branchy", out, y[start:end])
            else:
                (a, b), (c, d) = _halves(start, end)
                loss = loss + kit.summed_loss("branchy", model(x[a:b], even), y[a:b])
                loss = loss + kit.summed_loss("branchy", model(x[c:d], not even), y[c:d])
        (loss / BATCH).backward()
        optimizer.step()
    return kit.snapshot(model)


def test_rank_dependent_graphs_and_no_sync_match_single_process(world_size):
    results = run_ranks(_branches_rank, world_size, timeout=120)
    want = {s: _reference(world_size, s) for s in ("branches", "no_sync")}
    # The parameter no rank uses keeps grad None; with one rank, 'right' is unused too.
    assert want["branches"]["grad_is_none"]["never.weight"]
    assert want["branches"]["grad_is_none"]["right.weight"] == (world_size == 1)
    for rank, per_rank in enumerate(results):
        assert len(per_rank) == len(kit.VARIANTS) + len(OVERLAPPING)
        for (scenario, variant), got in per_rank.items():
            label = f"{scenario}/{variant} rank {rank}/{world_size}"
            kit.assert_matches(got, want[scenario], label)
