"""The pure partition function: cheap, so Hypothesis can draw many sizes and world sizes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zero1 import partition_parameters

sizes_st = st.lists(st.integers(0, 10_000), min_size=0, max_size=40)
ranks_st = st.integers(1, 9)


def _greedy_reference(sizes: list[int], ranks: int, loads: list[int]) -> list[int]:
    """The rule spelled out naively: largest first, onto the least-loaded, lowest rank."""
    loads = list(loads)
    owners = [-1] * len(sizes)
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    for i in order:
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += sizes[i]
    return owners


@settings(max_examples=200)
@given(sizes=sizes_st, ranks=ranks_st)
def test_matches_the_greedy_rule_and_bound(sizes: list[int], ranks: int) -> None:
    owners, loads = partition_parameters(sizes, ranks)
    assert owners == _greedy_reference(sizes, ranks, [0] * ranks)
    assert all(0 <= r < ranks for r in owners)
    assert loads == [sum(s for s, r in zip(sizes, owners) if r == k) for k in range(ranks)]
    assert sum(loads) == sum(sizes)
    largest = max(sizes, default=0)
    for load in loads:
        assert load * ranks <= sum(sizes) + largest * ranks


@settings(max_examples=120)
@given(first=sizes_st, second=sizes_st, ranks=ranks_st)
def test_continued_loads_keep_the_global_bound(
    first: list[int], second: list[int], ranks: int
) -> None:
    """Later groups continue the balance, so the bound holds for the whole model."""
    owners1, loads1 = partition_parameters(first, ranks)
    owners2, loads2 = partition_parameters(second, ranks, loads1)
    assert owners2 == _greedy_reference(second, ranks, loads1)
    everything = first + second
    assert sum(loads2) == sum(everything)
    largest = max(everything, default=0)
    assert max(loads2) * ranks <= sum(everything) + largest * ranks


@settings(max_examples=100)
@given(sizes=st.lists(st.integers(1, 1000), min_size=1, max_size=6), extra=st.integers(0, 4))
def test_more_ranks_than_parameters_gives_each_its_own_rank(sizes: list[int], extra: int) -> None:
    ranks = len(sizes) + extra
    owners, loads = partition_parameters(sizes, ranks)
    assert sorted(owners) == list(range(len(sizes)))  # the lowest ranks, one each
    assert loads.count(0) == extra


def test_deterministic_tie_breaking() -> None:
    owners, loads = partition_parameters([5, 5, 5, 5, 5], 2)
    assert owners == [0, 1, 0, 1, 0]
    assert loads == [15, 10]
    # Largest first: the 9 goes to rank 0, then the two 4s fill rank 1.
    assert partition_parameters([4, 9, 4], 2) == ([1, 0, 1], [9, 8])


@pytest.mark.parametrize(
    ("sizes", "ranks", "loads", "match"),
    [
        ([1], 0, None, "world_size"),
        ([1, -2], 2, None, "non-negative"),
        ([1], 2, [0, 0, 0], "loads"),
    ],
)
def test_rejects_bad_arguments(sizes, ranks, loads, match) -> None:
    with pytest.raises(ValueError, match=match):
        partition_parameters(sizes, ranks, loads)
