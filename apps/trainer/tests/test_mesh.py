"""The rank grid of ``parallel.mesh.Mesh``, without a process group: coordinates outermost
first, the ranks of each line, and the sizes it refuses (its groups are made by the Gloo
tests, ``test_tensor_parallel_gloo.py``)."""

from __future__ import annotations

import pytest

from lab2_trainer.parallel.mesh import Mesh


def test_tensor_parallel_ranks_are_adjacent():
    grid = {r: Mesh.data_tensor(2, rank=r, world_size=4) for r in range(4)}
    assert [m.coordinates for m in grid.values()] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert grid[3].ranks("tp") == [2, 3] and grid[3].ranks("dp") == [1, 3]
    assert grid[2].coordinate("dp") == 1 and grid[2].coordinate("tp") == 0
    assert grid[0].size("dp") == grid[0].size("tp") == 2
    assert grid[0].describe() == "dp 2 x tp 2"
    assert grid[0].group("tp") is None  # no process group: the default one
    assert Mesh.data_tensor(4, rank=1, world_size=4).ranks("tp") == [0, 1, 2, 3]


def test_a_third_dimension_goes_outermost():
    mesh = Mesh((("pp", 2), ("dp", 3), ("tp", 2)), rank=9, world_size=12)
    assert mesh.coordinates == (1, 1, 1)  # 9 = (1 * 3 + 1) * 2 + 1
    assert mesh.ranks("tp") == [8, 9]
    assert mesh.ranks("dp") == [7, 9, 11]
    assert mesh.ranks("pp") == [3, 9]


@pytest.mark.parametrize(("dims", "world", "message"), [
    ((("dp", 2), ("tp", 2)), 6, "needs 4 ranks, there are 6"),
    ((("dp", 0), ("tp", 2)), 0, "positive integer size"),
    ((("tp", 2), ("tp", 2)), 4, "distinct names"),
])
def test_sizes_that_do_not_fit_are_refused(dims, world, message):
    with pytest.raises(ValueError, match=message):
        Mesh(dims, rank=0, world_size=world)


def test_tp_must_divide_the_ranks_and_dimensions_are_named():
    with pytest.raises(ValueError, match="does not divide the 6 ranks"):
        Mesh.data_tensor(4, rank=0, world_size=6)
    with pytest.raises(KeyError, match="no dimension 'pp'"):
        Mesh.data_tensor(2, rank=0, world_size=4).size("pp")
