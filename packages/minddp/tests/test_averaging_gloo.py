"""minddp.Averager: the in-place asynchronous all-reduce leaves the mean."""

from __future__ import annotations

import torch

from lab2_testing import rank_programs as programs
from lab2_testing import run_ranks

TOLERANCE = {"torch.float32": 1e-6, "torch.float64": 1e-14, "torch.bfloat16": 2e-2}


def test_average_matches_the_mean_over_ranks(world_size):
    seed = int(torch.randint(0, 2**20, ()).item())
    results = run_ranks(programs.averaging_rank, world_size, seed, timeout=60)
    for dtype, tol in TOLERANCE.items():
        inputs = [
            torch.randn(37, generator=torch.Generator().manual_seed(seed + r),
                        dtype=torch.float64).to(getattr(torch, dtype.split(".")[1])).double()
            for r in range(world_size)
        ]
        expected = torch.stack(inputs).mean(0)
        for rank, got in enumerate(results):
            assert got["world_size"] == world_size
            assert not got["native"]  # Gloo has no AVG: divide, then sum
            assert got["collective"] == (world_size > 1)  # a group of one launches none
            err = float((got[dtype] - expected).norm() / expected.norm())
            assert err < tol, f"{dtype} rank {rank}/{world_size}: rel err {err:.2e}"
