"""Smoke test of an installed zero1: ShardedOptimizer(AdamW) on a one-rank Gloo group takes
the steps AdamW takes."""

import torch
from one_rank import model_and_bare_copy, one_rank_group

import zero1

with one_rank_group():
    model, bare = model_and_bare_copy()
    sharded = zero1.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    plain = torch.optim.AdamW(bare.parameters(), lr=1e-2)
    for _ in range(2):
        x = torch.randn(4, 8)
        for m, opt in ((model, sharded), (bare, plain)):
            opt.zero_grad()
            m(x).sum().backward()
            opt.step()
    for p, q in zip(model.parameters(), bare.parameters(), strict=True):
        torch.testing.assert_close(p, q)
print(f"zero1 {zero1.__version__}: ShardedOptimizer on one Gloo rank ok")
