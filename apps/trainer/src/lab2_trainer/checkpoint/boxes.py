"""Where a range of what a rank holds sits in the whole tensor: boxes.

A checkpoint stores every tensor in its whole shape, the shape it has at ``--tp 1``
(:mod:`lab2_trainer.checkpoint.parts`). A rank holds a *local* tensor: the whole one, or
under tensor parallelism its shard (:class:`Cut`: a block of rows, a block of columns, or
for the fused ``qkv`` one block of rows of each of q, k and v, stacked). The data-parallel
kinds then hold contiguous ranges of the local tensor's flat view (zero1's pieces, FSDP2's
rows, zero3's shards), and a range of a shard is not contiguous in the whole tensor.

A flat range of a local matrix is at most three rectangles of it: a partial first row,
whole middle rows, a partial last row (:func:`local_boxes`); each is contiguous in the
rank's memory. Shifted to where the shard sits, each is a box of the whole tensor, split
where the shard's blocks meet (``qkv``'s q, k and v): :meth:`Cut.boxes`. DCP reads and
writes boxes of N-D tensors, and finds the overlaps of any two sets of them, so a rank
writes exactly the boxes it holds and reads exactly those it needs, whatever cut and
sharding wrote the checkpoint.

Checkpoints of manifest version 1 stored every tensor as its flattened 1-D view:
:func:`flat_ranges` maps a box to the ranges of that view that hold it (one per row of the
box, or one where the box spans whole rows).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

#: A box: (its offsets in the whole tensor, its sizes, its first element in the local
#: tensor's flat view). The box's elements are contiguous there, in row-major order.
Box = tuple[tuple[int, ...], tuple[int, ...], int]


@dataclass(frozen=True)
class Cut:
    """How a rank's local tensor sits in the whole tensor.

    The local tensor is ``parts`` equal blocks along ``dim``; block ``b`` holds the
    ``index``-th of ``count`` equal shards of the whole tensor's block ``b`` along ``dim``
    (:class:`lab2_trainer.parallel.tensor.TensorLayout`'s rule). ``Cut()`` is a whole
    tensor.
    """

    dim: int = 0
    parts: int = 1
    index: int = 0
    count: int = 1

    @property
    def whole(self) -> bool:
        return self.count == 1

    def whole_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The whole tensor's shape, from the local tensor's."""
        out = list(shape)
        if not self.whole:
            out[self.dim] *= self.count
        return tuple(out)

    def boxes(self, shape: Sequence[int], start: int, stop: int) -> list[Box]:
        """The boxes of the whole tensor that elements ``start`` to ``stop`` of the local
        tensor's flat view (of local shape ``shape``) are, in order.

        Raises:
            ValueError: a tensor of more than two dimensions, or a range outside it.
        """
        if not 0 <= start <= stop <= math.prod(shape):
            raise ValueError(f"range {start}:{stop} lies outside a tensor of shape "
                             f"{list(shape)}")
        # Under a cut along columns into several blocks, a box of whole rows would not be
        # contiguous once split: rows one by one.
        merge = self.whole or self.dim == 0 or self.parts == 1
        out: list[Box] = []
        for box in local_boxes(shape, start, stop, merge_rows=merge):
            out += self._place(shape, box)
        return out

    def _place(self, shape: Sequence[int], box: Box) -> list[Box]:
        """A local box split where the blocks along ``dim`` meet, each piece moved to where
        its block's shard sits in the whole tensor."""
        if self.whole:
            return [box]
        offsets, sizes, flat = box
        d = self.dim
        block = shape[d] // self.parts
        step = math.prod(sizes[d + 1:])  # flat elements per index along d, inside the box
        lo, hi = offsets[d], offsets[d] + sizes[d]
        out = []
        at = lo
        while at < hi:
            b = at // block
            end = min(hi, (b + 1) * block)
            o, s = list(offsets), list(sizes)
            o[d] = b * block * self.count + self.index * block + (at - b * block)
            s[d] = end - at
            out.append((tuple(o), tuple(s), flat + (at - lo) * step))
            at = end
        return out


def local_boxes(shape: Sequence[int], start: int, stop: int, *,
                merge_rows: bool = True) -> list[Box]:
    """Elements ``start`` to ``stop`` of a tensor's flat view as boxes of the tensor: one
    for a vector; for a matrix a partial first row, the whole rows (one box, or one per
    row without ``merge_rows``) and a partial last row.

    Raises:
        ValueError: a tensor of more than two dimensions.
    """
    if stop <= start:
        return []
    if len(shape) == 1:
        return [((start,), (stop - start,), start)]
    if len(shape) != 2:
        raise ValueError(f"checkpoints store vectors and matrices; a tensor of shape "
                         f"{list(shape)} has {len(shape)} dimensions")
    cols = shape[1]
    out: list[Box] = []
    at = start
    while at < stop:
        row, col = divmod(at, cols)
        if col == 0 and stop - at >= cols:
            rows = (stop - at) // cols if merge_rows else 1
            out.append(((row, 0), (rows, cols), at))
            at += rows * cols
        else:
            n = min(cols - col, stop - at)
            out.append(((row, col), (1, n), at))
            at += n
    return out


def flat_ranges(size: Sequence[int], offsets: Sequence[int],
                sizes: Sequence[int]) -> list[tuple[int, int, int]]:
    """Where a box of a tensor of shape ``size`` lies in the tensor's flattened 1-D view
    (manifest version 1's layout): ``(start, length, first element in the box's flat
    view)`` for each contiguous range, one per row of the box, or one where the box spans
    whole rows."""
    if len(size) == 1:
        return [(offsets[0], sizes[0], 0)]
    rows, cols = sizes
    if cols == size[1]:
        return [(offsets[0] * cols, rows * cols, 0)]
    return [((offsets[0] + i) * size[1] + offsets[1], cols, i * cols) for i in range(rows)]
