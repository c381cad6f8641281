"""Every variant x model: distributed AdamW training equals single-process training."""

from __future__ import annotations

import functools
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
BATCH = 12  # divisible by every world size 1..4
SEED = 1234
KINDS = ("mlp", "tied", "transformer")


def _parity_rank(rank: int, world_size: int, split: list[int]) -> dict:
    torch.set_num_threads(1)
    return {
        (kind, variant): kit.train_distributed(kind, variant, rank, world_size, split, STEPS, SEED)
        for kind in KINDS
        for variant in kit.VARIANTS
    }


@functools.cache
def _reference(kind: str) -> dict:
    return kit.train_reference(kind, BATCH, STEPS, SEED)


def test_every_variant_and_model_matches_single_process_training(world_size):
    split = [BATCH // world_size] * world_size
    results = run_ranks(_parity_rank, world_size, split, timeout=120)
    for rank, per_rank in enumerate(results):
        assert len(per_rank) == len(KINDS) * len(kit.VARIANTS)
        for (kind, variant), got in per_rank.items():
            kit.assert_matches(got, _reference(kind), f"{kind}/{variant} rank {rank}/{world_size}")


def test_reference_training_moves_every_trainable_parameter():
    # Guards the oracle: parity would be vacuous if training changed nothing.
    for kind in KINDS:
        start = kit.snapshot(kit.build_model(kind, SEED))["params"]
        end = _reference(kind)["params"]
        for name, before in start.items():
            moved = not torch.equal(before, end[name])
            expected = name not in ("frozen_scale", "unused")
            assert moved == expected, f"{kind}: {name} moved={moved}"
