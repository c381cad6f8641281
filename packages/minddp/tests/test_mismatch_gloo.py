"""``broadcast_module`` and ``all_reduce_gradients`` on ranks whose models differ: every
rank raises ``ModelMismatchError`` naming the difference, no tensor is touched, and the
process group stays usable (no abort, no hang)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lab2_testing import run_ranks
from minddp import ModelMismatchError, all_reduce_gradients, broadcast_module

# How the last rank's model differs from the others', and what the message must name.
CASES = {
    "shape": ("0.weight", "shape=[9, 6]"),
    "transposed": ("2.weight", "shape=[8, 3]"),  # same number of elements
    "dtype": ("0.weight", "torch.float64"),
    "extra": ("3.weight", "the list ended"),
}


def _model(case: str | None, rank: int, world: int) -> nn.Module:
    torch.manual_seed(rank)  # different values on every rank
    odd = rank == world - 1
    hidden = 9 if odd and case == "shape" else 8
    layers = [nn.Linear(6, hidden), nn.Tanh(), nn.Linear(hidden, 3)]
    if odd and case == "transposed":
        layers[2] = nn.Linear(8, 3)
        layers[2].weight = nn.Parameter(torch.randn(8, 3))
    if odd and case == "extra":
        layers.append(nn.Linear(3, 3))
    model = nn.Sequential(*layers)
    return model.double() if odd and case == "dtype" else model


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {f"p:{k}": v.detach().clone() for k, v in model.named_parameters()}
    out.update({f"g:{k}": v.grad.clone() for k, v in model.named_parameters()
                if v.grad is not None})
    return out


def _unchanged(before: dict, model: nn.Module) -> bool:
    after = _snapshot(model)
    return before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in after)


def mismatch_rank(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    out: dict = {}
    for case in CASES:
        for op in ("broadcast", "flat", "per_parameter"):
            model = _model(case, rank, world)
            if op != "broadcast":
                for p in model.parameters():
                    p.grad = torch.full_like(p, float(rank + 1))
            before = _snapshot(model)
            try:
                if op == "broadcast":
                    broadcast_module(model)
                else:
                    all_reduce_gradients(model, flat=op == "flat")
                out[(case, op)] = (None, _unchanged(before, model))
            except ModelMismatchError as exc:
                out[(case, op)] = (str(exc), _unchanged(before, model))
    # The group still works: matching models broadcast and average as usual.
    model = _model(None, rank, world)
    broadcast_module(model)
    for p in model.parameters():
        p.grad = torch.full_like(p, float(rank + 1))
    all_reduce_gradients(model, flat=True)
    out["after"] = (model[0].weight.detach().clone(), float(model[0].weight.grad[0, 0]))
    return out


def test_mismatched_models_raise_on_every_rank_and_change_nothing(world_size):
    if world_size == 1:
        pytest.skip("needs two ranks")
    results = run_ranks(mismatch_rank, world_size, timeout=120, pg_timeout=30)
    for rank, got in enumerate(results):
        for case, (name, detail) in CASES.items():
            for op in ("broadcast", "flat", "per_parameter"):
                message, unchanged = got[(case, op)]
                assert message is not None, f"rank {rank}: {case} via {op} not detected"
                assert f"rank {world_size - 1}" in message and repr(name) in message, message
                assert detail in message, message
                assert unchanged, f"rank {rank}: {case} via {op} changed the model"
        weight, grad = got["after"]
        assert torch.equal(weight, results[0]["after"][0])
        assert grad == pytest.approx((world_size + 1) / 2)
