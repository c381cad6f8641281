"""Smoke test of an installed minddp: DDPBucketed on a one-rank Gloo group gives the
gradients of the bare model."""

import torch
from one_rank import model_and_bare_copy, one_rank_group

import minddp

with one_rank_group():
    model, bare = model_and_bare_copy()
    ddp = minddp.DDPBucketed(model, bucket_size_mb=0.0001)  # several buckets
    x = torch.randn(4, 8)
    ddp(x).sum().backward()
    ddp.finish_gradient_synchronization()
    bare(x).sum().backward()
    for p, q in zip(model.parameters(), bare.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
print(f"minddp {minddp.__version__}: DDPBucketed on one Gloo rank ok")
