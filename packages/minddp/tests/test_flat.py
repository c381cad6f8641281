"""minddp.flat (no process group): list-wide copy and zero (with torch's foreach kernels
and without), and flat packing."""

from __future__ import annotations

import pytest
import torch

from minddp import flat


def _tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(3, 4, generator=g),
        torch.randn(4, 3, generator=g, dtype=torch.float64).t(),  # not contiguous
        torch.randn(5, generator=g).to(torch.bfloat16),
        torch.randn(10, generator=g)[2:7],  # a view with an offset
    ]


@pytest.fixture(params=["foreach", "loop"])
def bulk(request, monkeypatch):
    if request.param == "loop":  # what runs on a torch without the foreach ops
        monkeypatch.setattr(flat, "_copy", None)
        monkeypatch.setattr(flat, "_zero", None)
    return flat


@pytest.mark.parametrize("count", [1, 4])
def test_copy_all_copies_every_pair(bulk, count):
    destinations, sources = _tensors(1)[:count], _tensors(2)[:count]
    bulk.copy_all(destinations, sources)
    for d, s in zip(destinations, sources):
        assert torch.equal(d, s)


def test_zero_all_zeroes_only_the_views_given(bulk):
    base = torch.randn(12, generator=torch.Generator().manual_seed(3)) + 5.0
    before = base.clone()
    bulk.zero_all([base[1:3], base[7:8]])
    assert torch.equal(base[1:3], torch.zeros(2)) and base[7] == 0
    keep = torch.ones(12, dtype=torch.bool)
    keep[1:3] = False
    keep[7] = False
    assert torch.equal(base[keep], before[keep])


def test_flatten_round_trip_and_grouping():
    tensors = [torch.randn(2, 3), torch.randn(4), torch.randn(1, 1, 2)]
    packed = flat.flatten_tensors(tensors)
    assert packed.shape == (12,)
    targets = [torch.empty_like(t) for t in tensors]
    flat.unflatten_into(packed, targets)
    assert all(torch.equal(a, b) for a, b in zip(tensors, targets))
    mixed = [torch.zeros(1), torch.zeros(1, dtype=torch.float64), torch.zeros(2)]
    assert flat.group_by_dtype_device(mixed) == [[0, 2], [1]]
