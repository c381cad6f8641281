"""Each layer on Gloo ranks against the same layer whole in one process, float64.

One spawn checks them all, with and without sequence parallelism: forward output, input
gradient and every weight and bias gradient (shards all-gathered first), for
``ColumnParallelLinear`` (output sharded or gathered, overlap on and off),
``RowParallelLinear`` (input sharded or whole), ``VocabParallelEmbedding`` (with a
padding row), ``split_to_sequence``, and the sequence-parallel layers again on the
fallback collectives (all-reduce then slice, all-gather into a list).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lab2_testing.dist import run_ranks
from lab2_testing.modules import load_path
from minitp import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    fallback_collectives,
    split_to_sequence,
)

tp_models = load_path(Path(__file__).with_name("tp_models.py"), "minitp_tests_tp_models")
B, T, D, VOCAB, DTYPE = tp_models.B, tp_models.T, tp_models.D, tp_models.VOCAB, tp_models.DTYPE
rel_err, seq_slice, gather = tp_models.rel_err, tp_models.seq_slice, tp_models.gather


def _inputs(seed: int, *shapes):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=DTYPE) for s in shapes]


def _column(rank, world, sp, gather_output, overlap):
    torch.manual_seed(1)
    full = nn.Linear(D, 2 * D).to(DTYPE)
    x, g = _inputs(2, (B, T, D), (B, T, 2 * D))
    xr = x.clone().requires_grad_()
    yr = full(xr)
    (yr * g).sum().backward()

    layer = ColumnParallelLinear.from_linear(full, gather_output=gather_output,
                                             sequence_parallel=sp,
                                             overlap_grad_reduce=overlap)
    xs = (seq_slice(x, rank, world) if sp else x).clone().requires_grad_()
    y = layer(xs)
    cols = slice(rank * 2 * D // world, (rank + 1) * 2 * D // world)
    want_y = yr if gather_output else yr[..., cols]
    (y * (g if gather_output else g[..., cols])).sum().backward()
    want_dx = seq_slice(xr.grad, rank, world) if sp else xr.grad
    return {"y": rel_err(y, want_y.detach()), "dx": rel_err(xs.grad, want_dx),
            "dW": rel_err(gather(layer.weight.grad, 0), full.weight.grad),
            "db": rel_err(gather(layer.bias.grad, 0), full.bias.grad)}


def _row(rank, world, sp, input_is_parallel):
    torch.manual_seed(3)
    full = nn.Linear(2 * D, D).to(DTYPE)
    x, g = _inputs(4, (B, T, 2 * D), (B, T, D))
    xr = x.clone().requires_grad_()
    yr = full(xr)
    (yr * g).sum().backward()

    layer = RowParallelLinear.from_linear(full, input_is_parallel=input_is_parallel,
                                          sequence_parallel=sp)
    cols = slice(rank * 2 * D // world, (rank + 1) * 2 * D // world)
    xs = (x[..., cols] if input_is_parallel else x).clone().requires_grad_()
    y = layer(xs)
    (y * (seq_slice(g, rank, world) if sp else g)).sum().backward()
    want_y = seq_slice(yr, rank, world) if sp else yr
    want_dx = xr.grad[..., cols] if input_is_parallel else xr.grad
    return {"y": rel_err(y, want_y.detach()), "dx": rel_err(xs.grad, want_dx),
            "dW": rel_err(gather(layer.weight.grad, 1), full.weight.grad),
            "db": rel_err(layer.bias.grad, full.bias.grad)}


def _embedding(rank, world, sp):
    torch.manual_seed(5)
    full = nn.Embedding(VOCAB, D, padding_idx=3).to(DTYPE)
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(6))
    ids[0, :3] = 3  # the padding row: looked up, no gradient
    (g,) = _inputs(7, (B, T, D))
    yr = full(ids)
    (yr * g).sum().backward()

    layer = VocabParallelEmbedding.from_embedding(full, sequence_parallel=sp)
    y = layer(ids)
    (y * (seq_slice(g, rank, world) if sp else g)).sum().backward()
    want_y = seq_slice(yr, rank, world) if sp else yr
    return {"y": rel_err(y, want_y.detach()),
            "dW": rel_err(gather(layer.weight.grad, 0), full.weight.grad)}


def _split(rank, world):
    x, g = _inputs(8, (B, T, D), (B, T, D))
    x.requires_grad_()
    y = split_to_sequence(x)
    (y * seq_slice(g, rank, world)).sum().backward()
    return {"y": rel_err(y, seq_slice(x, rank, world).detach()), "dx": rel_err(x.grad, g)}


def _column_autocast(rank, world, sp):
    """The column layer entering its region itself, under CPU bf16 autocast, against the
    whole float32 layer under the same autocast: the forward in bf16, gradients in each
    parameter's dtype (float32)."""
    torch.manual_seed(9)
    full = nn.Linear(D, 2 * D)
    x, g = (t.float() for t in _inputs(10, (B, T, D), (B, T, 2 * D)))
    xr = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yr = full(xr)
    (yr.float() * g).sum().backward()
    layer = ColumnParallelLinear.from_linear(full, sequence_parallel=sp)
    xs = (seq_slice(x, rank, world) if sp else x).clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(xs)
    cols = slice(rank * 2 * D // world, (rank + 1) * 2 * D // world)
    (y.float() * g[..., cols]).sum().backward()
    want_dx = seq_slice(xr.grad, rank, world) if sp else xr.grad
    dtypes = (y.dtype, xs.grad.dtype, layer.weight.grad.dtype)
    return {"y": rel_err(y.double(), yr[..., cols].detach().double()),
            "dx": rel_err(xs.grad.double(), want_dx.double()),
            "dW": rel_err(gather(layer.weight.grad, 0).double(), full.weight.grad.double()),
            "dtypes": 0.0 if dtypes == (torch.bfloat16, torch.float32, torch.float32) else 1.0}


def layers_rank(rank: int, world: int) -> dict[str, float]:
    errors: dict[str, float] = {}

    def add(case: str, errs: dict[str, float]) -> None:
        errors.update({f"{case}:{k}": v for k, v in errs.items()})

    for sp in (False, True):
        for gather_output in (False, True):
            for overlap in (True, False):
                add(f"column sp={sp} gather={gather_output} overlap={overlap}",
                    _column(rank, world, sp, gather_output, overlap))
        for input_is_parallel in (True, False):
            add(f"row sp={sp} input_is_parallel={input_is_parallel}",
                _row(rank, world, sp, input_is_parallel))
        add(f"embedding sp={sp}", _embedding(rank, world, sp))
    add("split_to_sequence", _split(rank, world))
    for sp in (False, True):
        add(f"autocast column sp={sp}", _column_autocast(rank, world, sp))
    with fallback_collectives():
        add("fallback column sp", _column(rank, world, True, False, True))
        add("fallback row sp", _row(rank, world, True, True))
        add("fallback column gather", _column(rank, world, False, True, False))
    return errors


def test_layers_match_single_process(world_size):
    results = run_ranks(layers_rank, world_size, timeout=90)
    for rank, errors in enumerate(results):
        # Under bf16 autocast the sums differ in rounding order only: bf16's tolerance.
        bad = {k: v for k, v in errors.items()
               if not v < (2e-2 if k.startswith("autocast") else tp_models.TOL)}
        assert not bad, f"rank {rank}: {bad}"

