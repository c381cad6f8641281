"""Bucket assignment: pure logic, no process group."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minddp import BUCKET_RULES, validate_bucket_size_mb
from minddp.buckets import TensorInfo, assign_buckets
from minddp.flat import adopt_gradients

MIB = 2**20


def _nbytes(infos, members):
    return sum(infos[i].numel * infos[i].element_size for i in members)


infos_strategy = st.lists(
    st.builds(
        TensorInfo,
        numel=st.integers(0, 3000),
        element_size=st.sampled_from([2, 4, 8]),
        group=st.sampled_from(["a", "b"]),
    ),
    max_size=12,
)
cap_strategy = st.one_of(st.none(), st.integers(1, 20000).map(lambda b: b / MIB))


@given(infos=infos_strategy, cap=cap_strategy, data=st.data())
def test_buckets_partition_follow_order_respect_cap_and_are_greedy(infos, cap, data):
    order = data.draw(st.permutations(range(len(infos))))
    buckets = assign_buckets(infos, cap, order)
    position = {index: pos for pos, index in enumerate(order)}
    # a partition of all indices
    assert sorted(i for b in buckets for i in b) == list(range(len(infos)))
    assert all(buckets)
    # each bucket is one group, listed in order; buckets sorted by their first member
    for b in buckets:
        assert len({infos[i].group for i in b}) == 1
        assert [position[i] for i in b] == sorted(position[i] for i in b)
    assert [position[b[0]] for b in buckets] == sorted(position[b[0]] for b in buckets)
    # per group, the buckets cut the group's own sequence into consecutive runs
    for group in {"a", "b"}:
        runs = [b for b in buckets if infos[b[0]].group == group]
        assert [i for b in runs for i in b] == [i for i in order if infos[i].group == group]
        if cap is None:
            assert len(runs) <= 1
            continue
        for b, nxt in zip(runs, runs[1:]):
            # within the cap unless alone; closed only because the next one did not fit
            assert len(b) == 1 or _nbytes(infos, b) <= cap * MIB
            assert _nbytes(infos, b) + _nbytes(infos, nxt[:1]) > cap * MIB
        assert not runs or len(runs[-1]) == 1 or _nbytes(infos, runs[-1]) <= cap * MIB


def test_default_order_is_reverse_registration():
    infos = [TensorInfo(10, 4, "g") for _ in range(5)]
    assert assign_buckets(infos, None) == [[4, 3, 2, 1, 0]]
    assert assign_buckets(infos, 1e-9) == [[4], [3], [2], [1], [0]]
    assert assign_buckets(infos, 80 / MIB) == [[4, 3], [2, 1], [0]]


def test_a_parameter_larger_than_the_cap_sits_alone():
    infos = [TensorInfo(1, 4, "g"), TensorInfo(1000, 4, "g"), TensorInfo(1, 4, "g")]
    assert assign_buckets(infos, 8 / MIB) == [[2], [1], [0]]


def test_groups_never_share_a_bucket():
    infos = [TensorInfo(1, 4, "fp32"), TensorInfo(1, 2, "bf16"), TensorInfo(1, 4, "fp32")]
    assert assign_buckets(infos, None) == [[2, 0], [1]]


def test_order_must_be_a_permutation():
    infos = [TensorInfo(1, 4, "g")] * 3
    with pytest.raises(ValueError, match="permutation"):
        assign_buckets(infos, None, [0, 0, 1])


@pytest.mark.parametrize("bad", [0, -2.5, float("nan"), float("inf")])
def test_bucket_size_must_be_positive_and_finite(bad):
    with pytest.raises(ValueError, match="bucket_size_mb"):
        validate_bucket_size_mb(bad)


@pytest.mark.parametrize("bad", ["25", True, [1]])
def test_bucket_size_must_be_a_number(bad):
    with pytest.raises(TypeError, match="bucket_size_mb"):
        validate_bucket_size_mb(bad)


@given(infos=infos_strategy, cap=st.integers(1, 20000).map(lambda b: b / MIB), data=st.data())
def test_reach_closes_a_bucket_once_it_holds_the_cap(infos, cap, data):
    # PyTorch DDP's rule: the same partition properties, each bucket but the last of its
    # group holds at least the cap, and none would still be under it without its last
    # member.
    order = data.draw(st.permutations(range(len(infos))))
    buckets = assign_buckets(infos, cap, order, rule="reach")
    assert sorted(i for b in buckets for i in b) == list(range(len(infos)))
    for group in {"a", "b"}:
        runs = [b for b in buckets if infos[b[0]].group == group]
        assert [i for b in runs for i in b] == [i for i in order if infos[i].group == group]
        for b in runs[:-1]:
            assert _nbytes(infos, b) >= cap * MIB > _nbytes(infos, b[:-1])
        if runs:
            assert _nbytes(infos, runs[-1][:-1]) < cap * MIB


def test_reach_makes_about_half_as_many_buckets():
    # Equal parameters of 60 % of the cap: "at_most" puts each alone, "reach" pairs them.
    infos = [TensorInfo(60, 1, "g") for _ in range(6)]
    assert len(assign_buckets(infos, 100 / MIB)) == 6
    assert assign_buckets(infos, 100 / MIB, rule="reach") == [[5, 4], [3, 2], [1, 0]]
    assert assign_buckets(infos, None, rule="reach") == [[5, 4, 3, 2, 1, 0]]


def test_unknown_rule_is_refused():
    assert BUCKET_RULES == ("at_most", "reach")
    with pytest.raises(ValueError, match="bucket_rule"):
        assign_buckets([TensorInfo(1, 4, "g")], 1.0, rule="over")


@pytest.mark.parametrize("whole", [False, True])
def test_adopt_gradients_points_every_grad_at_its_view_keeping_its_value(whole):
    g = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(2, 3, generator=g)) for _ in range(3)]
    buffer = torch.full((18,), 7.0)
    views = [buffer[6 * i : 6 * i + 6].view(2, 3) for i in range(3)]
    fresh = torch.randn(2, 3, generator=g)
    params[0].grad = fresh.clone()  # a gradient held elsewhere: copied in
    params[2].grad = views[2]  # already the view: left as it is
    missing = adopt_gradients(params, views, buffer if whole else None)
    assert missing == [1]
    assert all(p.grad is v for p, v in zip(params, views))
    assert torch.equal(views[0], fresh)
    assert torch.equal(views[1], torch.zeros(2, 3))
    assert torch.equal(views[2], torch.full((2, 3), 7.0))
    for p in params:
        p.grad = None
    assert adopt_gradients(params, views, buffer if whole else None) == [0, 1, 2]
    assert torch.equal(buffer, torch.zeros(18))
