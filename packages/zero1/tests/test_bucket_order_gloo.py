"""Buckets follow the order gradients arrive in (stages 1 and 2 on Gloo).

The model registers its layers before its embedding, so backward reaches the embedding
last although reverse registration order puts it near the front. In the first step the
buckets follow reverse registration order and stage 2 keeps most full-size gradients
alive until the embedding's arrives; from the second step on, after the buckets were
rebuilt along rank 0's arrival order, at most one bucket of them is alive at any moment
of backward (measured with hooks). A checkpoint loaded before the rebuild keeps its
state, and training matches one process on the full batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lab2_testing.dist import run_ranks
from zero1 import ShardedOptimizer

pytestmark = [pytest.mark.gloo, pytest.mark.timeout(300)]

VOCAB, DIM, BATCH = 32, 32, 12
LAYER_BYTES = (DIM * DIM + DIM) * 4  # one Linear in float32: the largest bucket


class LayersFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(4))
        self.embed = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, VOCAB, (BATCH, 3), generator=gen),
            torch.randint(0, VOCAB, (BATCH, 3), generator=gen))


def _loss(model: nn.Module, step: int, rank: int, world: int) -> torch.Tensor:
    x, y = _batch(step)
    per = BATCH // world
    logits = model(x[rank * per : (rank + 1) * per])
    return F.cross_entropy(logits.flatten(0, 1), y[rank * per : (rank + 1) * per].flatten())


def _peak_grad_bytes(model: nn.Module, loss: torch.Tensor) -> int:
    """The most bytes of ``.grad`` tensors alive at any gradient hook during backward
    (hooks registered after the optimizer's, so they see what it left)."""
    params = list(model.parameters())
    peak = [0]

    def hook(_p: torch.Tensor) -> None:
        alive = sum(p.grad.numel() * p.grad.element_size() for p in params
                    if p.grad is not None)
        peak[0] = max(peak[0], alive)

    handles = [p.register_post_accumulate_grad_hook(hook) for p in params]
    loss.backward()
    for h in handles:
        h.remove()
    return peak[0]


def _order_rank(rank: int, world: int, stage: int, state: dict | None) -> dict:
    torch.set_num_threads(1)
    model = LayersFirst()
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage,
                           bucket_size_mb=LAYER_BYTES / 2**20, bucket_rule="at_most",
                           lr=0.01)
    if state is not None:  # a checkpoint loaded before the buckets are rebuilt
        state = copy.deepcopy(state)  # the optimizer steps the loaded tensors in place
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
    peaks, buckets = [], []
    for step in range(3):
        peaks.append(_peak_grad_bytes(model, _loss(model, step, rank, world)))
        opt.step()
        opt.zero_grad()
        buckets.append([len(b.members) for b in opt._buckets.buckets] if opt._buckets else [])
    return {"peaks": peaks, "buckets": buckets,
            "params": [p.detach().clone() for p in model.parameters()]}


def _reference(world: int, state: dict | None) -> list[torch.Tensor]:
    model = LayersFirst()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    if state is not None:
        state = copy.deepcopy(state)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
    for step in range(3):
        (sum(_loss(model, step, r, world) for r in range(world)) / world).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def _checkpoint() -> dict:
    """A plain AdamW's model and state after two steps (a checkpoint to resume from)."""
    model = LayersFirst()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in (7, 8):
        _loss(model, step, 0, 1).backward()
        opt.step()
        opt.zero_grad()
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": opt.state_dict()}


CASES = [(stage, resume) for stage in (1, 2) for resume in (False, True)]


def _all_cases(rank: int, world: int, state: dict) -> dict:
    return {case: _order_rank(rank, world, case[0], state if case[1] else None)
            for case in CASES}


def test_buckets_follow_the_gradient_order(world_size):
    state = _checkpoint()
    results = run_ranks(_all_cases, world_size, state, timeout=240, pg_timeout=120)
    for stage, resume in CASES:
        want = _reference(world_size, state if resume else None)
        for rank_results in results:
            got = rank_results[(stage, resume)]
            for p, q in zip(got["params"], want):
                assert ((p - q).norm() / q.norm()).item() < 1e-5, (stage, resume)
            first = results[0][(stage, resume)]["params"]
            assert all(torch.equal(a, b) for a, b in zip(got["params"], first))
            if world_size > 1 and stage == 2:
                peak, *later = got["peaks"]
                assert peak > 2 * LAYER_BYTES, got["peaks"]  # registration order: many wait
                assert all(p <= LAYER_BYTES for p in later), got["peaks"]
