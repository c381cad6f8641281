"""Every variant x model: distributed AdamW training equals single-process training."""

from __future__ import annotations

import functools

import torch

from lab2_testing import ddp_testkit as kit
from lab2_testing import rank_programs as programs
from lab2_testing import run_ranks


@functools.cache
def _reference(kind: str) -> dict:
    return kit.train_reference(
        kind, programs.PARITY_BATCH, programs.PARITY_STEPS, programs.PARITY_SEED
    )


def test_every_variant_and_model_matches_single_process_training(world_size):
    split = [programs.PARITY_BATCH // world_size] * world_size
    results = run_ranks(programs.parity_rank, world_size, split, timeout=120)
    for rank, per_rank in enumerate(results):
        assert len(per_rank) == len(programs.PARITY_KINDS) * len(kit.VARIANTS)
        for (kind, variant), got in per_rank.items():
            kit.assert_matches(got, _reference(kind), f"{kind}/{variant} rank {rank}/{world_size}")


def test_gradients_zeroed_in_place_between_steps_match_too(world_size):
    # zero_grad(set_to_none=False): autograd accumulates into the existing .grad tensors
    # (the bucket views) instead of handing the hooks fresh ones.
    split = [programs.PARITY_BATCH // world_size] * world_size
    results = run_ranks(programs.zeroed_gradients_rank, world_size, split, timeout=120)
    for rank, per_rank in enumerate(results):
        for (kind, variant), got in per_rank.items():
            kit.assert_matches(got, _reference(kind), f"{kind}/{variant} zeroed in place, "
                                                      f"rank {rank}/{world_size}")


def test_reference_training_moves_every_trainable_parameter():
    # Guards the oracle: parity would be vacuous if training changed nothing.
    for kind in programs.PARITY_KINDS:
        start = kit.snapshot(kit.build_model(kind, programs.PARITY_SEED))["params"]
        end = _reference(kind)["params"]
        for name, before in start.items():
            moved = not torch.equal(before, end[name])
            expected = name not in ("frozen_scale", "unused")
            assert moved == expected, f"{kind}: {name} moved={moved}"
