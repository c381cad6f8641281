"""Smoke test of an installed zero1: ShardedOptimizer(AdamW) on a one-rank Gloo group takes
the steps AdamW takes."""

import copy
import tempfile

import torch
import torch.distributed as dist

import zero1

with tempfile.TemporaryDirectory() as tmp:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0,
                            world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 1))
        bare = copy.deepcopy(model)
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
    finally:
        dist.destroy_process_group()
print(f"zero1 {zero1.__version__}: ShardedOptimizer on one Gloo rank ok")
