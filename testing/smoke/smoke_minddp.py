"""Smoke test of an installed minddp: DDPBucketed on a one-rank Gloo group gives the
gradients of the bare model."""

import copy
import tempfile

import torch
import torch.distributed as dist

import minddp

with tempfile.TemporaryDirectory() as tmp:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0,
                            world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 1))
        bare = copy.deepcopy(model)
        ddp = minddp.DDPBucketed(model, bucket_size_mb=0.0001)  # several buckets
        x = torch.randn(4, 8)
        ddp(x).sum().backward()
        ddp.finish_gradient_synchronization()
        bare(x).sum().backward()
        for p, q in zip(model.parameters(), bare.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)
    finally:
        dist.destroy_process_group()
print(f"minddp {minddp.__version__}: DDPBucketed on one Gloo rank ok")
