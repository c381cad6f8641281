"""Boxes: where a flat range of what a rank holds sits in the whole tensor
(``checkpoint.boxes``), against the tensor-parallel cut itself (``TensorLayout.shard``).

For every cut the trainer makes (rows, columns, the fused qkv's three row blocks; a
vector cut in blocks) at tp 1-4 and any range of the local tensor's flat view: the boxes
tile the range in order, each is contiguous in the rank's memory, and the whole tensor
read at each box's place holds exactly the local elements of the box. Read from the
whole tensor's flat view (manifest version 1's layout) at :func:`flat_ranges`, each box
holds the same.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lab2_trainer.checkpoint.boxes import Cut, flat_ranges, local_boxes
from lab2_trainer.checkpoint.parts import Range
from lab2_trainer.parallel.tensor import TensorLayout


@st.composite
def cases(draw):
    tp = draw(st.integers(1, 4))
    dim, parts = draw(st.sampled_from([(0, 1), (1, 1), (0, 3), (1, 2)]))
    vector = dim == 0 and draw(st.booleans())
    block = [draw(st.integers(1, 3)), draw(st.integers(1, 5))]
    shape = [block[0], block[1]]
    shape[dim] *= parts * tp  # parts equal blocks, each cut into tp shards
    if vector:
        shape = shape[:1]
    numel_local = math.prod(shape) // tp
    start = draw(st.integers(0, numel_local))
    stop = draw(st.integers(start, numel_local))
    index = draw(st.integers(0, tp - 1))
    return tuple(shape), dim, parts, tp, index, start, stop


@settings(max_examples=300, deadline=None)
@given(cases())
def test_boxes_hold_exactly_the_local_range(case):
    shape, dim, parts, tp, index, start, stop = case
    whole = torch.randn(shape, dtype=torch.float64)
    layout = TensorLayout(None, tp, index, False, {"w": (dim, parts)})
    local = layout.shard("w", whole).contiguous()
    cut = Cut(dim, parts, index, tp)
    assert cut.whole_shape(local.shape) == shape
    boxes = cut.boxes(local.shape, start, stop)
    flat = local.reshape(-1)
    at = start
    for offsets, sizes, first in boxes:
        assert first == at  # in order, no gap, no overlap
        n = math.prod(sizes)
        assert n > 0
        box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        assert torch.equal(whole[box].reshape(-1), flat[first:first + n])
        # The same elements in the whole tensor's flat view (manifest version 1).
        got = torch.empty(n, dtype=whole.dtype)
        for begin, length, inside in flat_ranges(shape, offsets, sizes):
            got[inside:inside + length] = whole.reshape(-1)[begin:begin + length]
        assert torch.equal(got, flat[first:first + n])
        at += n
    assert at == stop
    # A matrix's range is at most a partial row, whole rows and a partial row, each split
    # where the blocks meet (or, cut along columns in blocks, row by row).
    if len(shape) == 2 and not (dim == 1 and parts > 1):
        assert len(boxes) <= 2 + parts


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6), st.data())
def test_a_range_of_a_whole_matrix_is_at_most_three_boxes(rows, cols, data):
    start = data.draw(st.integers(0, rows * cols))
    stop = data.draw(st.integers(start, rows * cols))
    boxes = local_boxes((rows, cols), start, stop)
    assert len(boxes) <= 3
    assert sum(math.prod(s) for _, s, _ in boxes) == stop - start


def test_a_range_splits_between_the_ranks_that_hold_it_and_yields_views():
    data = torch.arange(24.0)
    r = Range("model.w", (4, 6), 0, data, Cut(0, 1, 1, 2), copies=(1, 3))
    mine = r.to_write()
    assert (mine.start, mine.data.tolist()) == (8, list(range(8, 16)))
    assert not mine.writes_first()
    parts = mine.parts()
    assert [(p.offsets, tuple(p.data.shape)) for p in parts] == [((5, 2), (1, 4)),
                                                                ((6, 0), (1, 4))]
    parts[0].data.fill_(-1)  # a view: a load writes into the rank's tensor
    assert data[8:12].tolist() == [-1] * 4
    assert Range("model.w", (4, 6), 0, data, Cut(0, 1, 0, 2), (0, 3)).writes_first()


def test_tensors_of_more_than_two_dimensions_are_refused():
    with pytest.raises(ValueError, match="3 dimensions"):
        local_boxes((2, 2, 2), 0, 8)
