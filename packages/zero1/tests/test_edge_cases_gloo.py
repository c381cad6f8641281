"""Gloo ranks at the edges: an optimizer with nothing to train steps as a no-op (and trains
what is added later as the plain optimizer does), and a dropped stage-3 model is freed."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import zero1
from lab2_testing.dist import run_ranks
from zero1 import ShardedOptimizer

BATCH = 12  # divisible by every world size 1-4
#: (stage, reduce_gradients): both stages of the reduce-scatter path, and the broadcast path.
PATHS = [(1, True), (2, True), (1, False)]


def _frozen_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    model.requires_grad_(False)
    return model


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return (torch.randn(BATCH, 6, generator=gen, dtype=torch.float64),
            torch.randn(BATCH, 3, generator=gen, dtype=torch.float64))


def _nothing_to_train(rank: int, world_size: int) -> dict:
    out = {}
    for stage, reduce in PATHS:
        model = _frozen_model()
        before = [p.clone() for p in model.parameters()]
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage,
                               reduce_gradients=reduce, lr=0.1)
        losses = []
        for step in range(3):
            x, y = _batch(step)
            opt.zero_grad()
            norm = opt.clip_grad_norm_(1.0)
            losses.append(opt.step(lambda m=model, x=x, y=y: (m(x) - y).square().mean()).item())
        unchanged = all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
        # Unfreezing later: a new group of trainable parameters trains as the plain
        # optimizer does on the full batch (every rank its slice, gradients averaged).
        head = nn.Linear(3, 2).double()
        plain_head = nn.Linear(3, 2).double()
        plain_head.load_state_dict(head.state_dict())
        plain = torch.optim.AdamW(plain_head.parameters(), lr=0.1)
        opt.add_param_group({"params": list(head.parameters()), "lr": 0.1})
        per = BATCH // world_size
        for step in range(3):
            x, y = _batch(step)
            target = y[:, :2]
            opt.zero_grad()
            mine = slice(rank * per, (rank + 1) * per)
            loss = (head(model(x[mine])) - target[mine]).square().mean()
            loss.backward()
            if not reduce:  # the broadcast path: averaged by hand, as a DDP wrapper would
                for p in head.parameters():
                    torch.distributed.all_reduce(p.grad)
                    p.grad.div_(world_size)
            opt.step()
            plain.zero_grad()
            (plain_head(model(x)) - target).square().mean().backward()
            plain.step()
        error = max(float((p - q).norm() / q.norm())
                    for p, q in zip(head.parameters(), plain_head.parameters()))
        out[(stage, reduce)] = dict(unchanged=unchanged, losses=losses, norm=float(norm),
                                    error=error)
    return out


def test_an_optimizer_with_nothing_to_train_steps_as_a_no_op(world_size):
    results = run_ranks(_nothing_to_train, world_size, timeout=180)
    for path in PATHS:
        got = [r[path] for r in results]
        assert all(g["unchanged"] for g in got), (path, got)
        assert all(g["norm"] == 0.0 for g in got), (path, got)
        assert all(g["losses"] == got[0]["losses"] for g in got), (path, got)  # same on all
        assert all(g["error"] < 1e-12 for g in got), (path, got)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3))
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _train_and_drop(rank: int, world_size: int) -> list[weakref.ref]:
    net = _Net()
    zero1.shard_model(net)
    sharded = zero1.sharding_of(net)
    opt = zero1.Stage3Optimizer(net.parameters(), torch.optim.AdamW, lr=1e-2)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    net(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    refs = [weakref.ref(net), weakref.ref(sharded), *map(weakref.ref, net.parameters())]
    return refs + [weakref.ref(t) for u in sharded.units for t in (u.shard, u.full)]


def _dropped_models(rank: int, world_size: int) -> tuple[int, int]:
    refs = [r for _ in range(3) for r in _train_and_drop(rank, world_size)]
    gc.collect()
    return sum(r() is not None for r in refs), len(refs)


def test_dropped_stage3_models_are_freed(world_size):
    for alive, total in run_ranks(_dropped_models, world_size, timeout=120):
        assert total > 0 and alive == 0, f"{alive} of {total} objects outlived their model"


@pytest.mark.parametrize("stage", [1, 2])
def test_nothing_to_train_in_one_process(stage):
    model = _frozen_model()
    opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, stage=stage, lr=0.1)
    opt.step()
    assert opt.state == {} and opt.num_buckets == 0
