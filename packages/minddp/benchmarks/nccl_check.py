"""NCCL check for a machine with 2+ GPUs (a script, not a test: CI has no GPU).

DDPBucketed and DDPIndividualParameters train 3 AdamW steps in float64 on two GPUs, each
rank on half of every batch and rank 1 starting from other weights (the wrapper must
broadcast rank 0's), and must match one process trained on the whole batch. It also
reports whether NCCL's native AVG was used.

Usage, from the repository root:
    PYTHONPATH=packages/minddp/src python3 packages/minddp/benchmarks/nccl_check.py
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.functional import mse_loss

from minddp import DDPBucketed, DDPIndividualParameters

STEPS, BATCH, WORLD = 3, 16, 2
WRAPPERS = {
    "bucketed": lambda m: DDPBucketed(m, bucket_size_mb=0.01),  # several buckets
    "individual": DDPIndividualParameters,
}


def build_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
        torch.nn.Linear(64, 8),
    ).double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, 32, generator=g, dtype=torch.float64)
    return x, torch.randn(BATCH, 8, generator=g, dtype=torch.float64)


def reference() -> list[torch.Tensor]:
    model = build_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = batch(step)
        optimizer.zero_grad()
        mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def rank_main(rank: int, init: str, queue) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=WORLD)
    out = {}
    for name, wrap in WRAPPERS.items():
        model = build_model(0 if rank == 0 else 7).cuda()
        ddp = wrap(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        share = BATCH // WORLD
        for step in range(STEPS):
            x, y = (t[rank * share : (rank + 1) * share].cuda() for t in batch(step))
            optimizer.zero_grad(set_to_none=True)
            mse_loss(ddp(x), y).backward()
            ddp.finish_gradient_synchronization()
            optimizer.step()
        # numpy arrays travel by value; torch tensors would go through shared memory that
        # this process may have released before the parent reads the queue.
        params = [p.detach().cpu().numpy() for p in model.parameters()]
        out[name] = (params, ddp._averager.native_average)
    queue.put((rank, out))
    dist.destroy_process_group()


def main() -> int:
    if torch.cuda.device_count() < WORLD:
        print(f"needs {WORLD} GPUs, found {torch.cuda.device_count()}")
        return 1
    want = reference()
    init = "file://" + os.path.join(tempfile.mkdtemp(), "rendezvous")
    queue = mp.get_context("spawn").Queue()
    ranks = mp.spawn(rank_main, args=(init, queue), nprocs=WORLD, join=False)
    # Read before joining (a put blocks until read), with a deadline: a rank that raised
    # before its put is reported by join(), not waited for.
    try:
        results = dict(queue.get(timeout=600) for _ in range(WORLD))
    except Exception:  # queue.Empty: some rank never answered
        ranks.join(timeout=5)
        raise
    while not ranks.join():
        pass
    ok = True
    for rank, out in sorted(results.items()):
        for name, (params, native) in out.items():
            err = max(float((torch.from_numpy(a) - b).norm() / b.norm())
                      for a, b in zip(params, want))
            ok &= err < 1e-10
            print(f"rank {rank} {name:10s} native AVG={native} max rel err {err:.2e}")
    print("NCCL check", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
