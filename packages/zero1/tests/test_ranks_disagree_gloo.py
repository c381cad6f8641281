"""Ranks that disagree (Gloo): every rank raises the same clear error at construction, or
the step stays consistent; nothing crashes the processes or aborts at
``destroy_process_group`` (the rank launcher calls it after each function returns).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lab2_testing.dist import run_ranks
from minddp import ModelMismatchError
from zero1 import ShardedOptimizer

pytestmark = [pytest.mark.gloo, pytest.mark.timeout(300)]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])


def _error(params, cls, **kwargs) -> str | None:
    try:
        ShardedOptimizer(params, cls, **kwargs)
    except ModelMismatchError as err:
        assert isinstance(err, ValueError)
        return str(err)
    return None


def _disagree_rank(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    out: dict = {}
    for stage in (1, 2):
        model = _model()
        if rank == world - 1:  # the last rank freezes a layer the others train
            model[0].requires_grad_(False)
        out[f"frozen-{stage}"] = _error(list(model.parameters()), torch.optim.AdamW,
                                        stage=stage, lr=0.1)
        torch.manual_seed(1)
        a, b = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))
        params = [b, a] if rank == world - 1 else [a, b]  # same shapes, another order
        out[f"order-{stage}"] = _error(params, torch.optim.SGD, stage=stage, lr=0.1)
    out["broadcast-path-order"] = _error(params, torch.optim.SGD, reduce_gradients=False,
                                         lr=0.1)
    # Backward on rank 0 only: the other ranks send zeros; every rank steps alike.
    for stage in (1, 2):
        model = _model()
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage,
                               bucket_size_mb=300 / 2**20, lr=0.01)
        for _ in range(2):
            if rank == 0:
                model(torch.ones(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        out[f"one-backward-{stage}"] = [p.detach().clone() for p in model.parameters()]
    return out


def test_ranks_that_disagree(world_size):
    if world_size == 1:
        pytest.skip("needs two ranks or more")
    results = run_ranks(_disagree_rank, world_size, timeout=240, pg_timeout=60)
    for got in results:
        for stage in (1, 2):
            assert "requires_grad True vs False" in got[f"frozen-{stage}"], got
            assert "initial values" in got[f"order-{stage}"], got
        assert "initial values" in got["broadcast-path-order"], got
    # The one rank's backward, averaged over the ranks: one process on loss / N.
    for stage in (1, 2):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        for _ in range(2):
            (model(torch.ones(2, 8)).sum() / world_size).backward()
            opt.step()
            opt.zero_grad()
        for got in results:
            for p, q in zip(got[f"one-backward-{stage}"], model.parameters()):
                assert ((p - q).norm() / q.norm()).item() < 1e-5, stage
