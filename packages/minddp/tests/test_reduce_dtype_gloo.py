"""DDPBucketed(reduce_dtype=...): gradients averaged in a narrower dtype, within its rounding."""

from __future__ import annotations

import pytest
import torch

from lab2_testing import ddp_testkit as kit
from lab2_testing import rank_programs as programs
from lab2_testing import run_ranks
from minddp import DDPBucketed

# Norm-relative error of the averaged gradients against float64 single-process ones.
TOLERANCE = {"float32": 1e-6, "bfloat16": 1.5e-2, "float16": 2e-3}


def _reference(kind: str, seed: int, size: int) -> dict:
    model = kit.build_model(kind, seed)
    return programs.one_step_gradients(kind, model, model, lambda: None, 0, 1, [size], seed)


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_gradients_match_single_process_within_the_wire_dtype(world_size, dtype_name):
    seed = int(torch.randint(0, 2**20, ()).item())
    split = [12 // world_size] * world_size
    results = run_ranks(programs.reduce_dtype_rank, world_size, split, seed, dtype_name,
                        timeout=120)
    for kind in programs.REDUCE_KINDS:
        want = _reference(kind, seed, 12)
        for rank, per_rank in enumerate(results):
            got = per_rank[kind]
            assert got.keys() == want.keys()
            for name, ref in want.items():
                label = f"{kind}/{name} rank {rank}/{world_size} via {dtype_name}"
                assert (got[name] is None) == (ref is None), label
                if ref is None:
                    continue
                err = float((got[name] - ref).norm() / ref.norm().clamp_min(1e-30))
                assert err <= TOLERANCE[dtype_name], f"{label}: off by {err:.2e}"


def test_reduce_dtype_must_be_a_floating_dtype():
    with pytest.raises(TypeError, match="reduce_dtype"):
        DDPBucketed(torch.nn.Linear(2, 2), reduce_dtype=torch.int32)
