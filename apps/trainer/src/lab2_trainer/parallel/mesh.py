"""The ranks as a grid of named dimensions: :class:`Mesh`.

A run's ranks form a mesh, outermost dimension first: ``(("dp", 2), ("tp", 2))`` on four
ranks puts rank ``r`` at ``dp = r // 2``, ``tp = r % 2``. The innermost dimension's ranks
are adjacent (on one node they share the fastest links), which is where tensor
parallelism, the chattiest dimension, goes. A pipeline dimension would go outermost,
``(("pp", p), ("dp", d), ("tp", t))``, with nothing here changing::

    rank = ((pp_index * dp) + dp_index) * tp + tp_index

          tp 0   tp 1
    dp 0  rank 0 rank 1     each row: one tensor-parallel group (the model cut in two)
    dp 1  rank 2 rank 3     each column: one data-parallel group (the same shard)

Each dimension has one process group per line of the grid along it: the ranks that differ
only in that coordinate. Every rank makes every group of every dimension, in the same
order (``torch.distributed.new_group`` is a collective over the whole world), and keeps
its own. A dimension that spans every rank uses the default group (nothing is made), so a
mesh of one dimension costs no group at all; a dimension of size 1 on several ranks gets
one-rank groups, which the data-parallel families take even alone (a sharded optimizer
over one rank).

The trainer makes a mesh only with ``--tp`` > 1: at ``--tp 1`` the data-parallel ranks are
the world and nothing here runs but :func:`random_seed`, the seed of each rank's default
random generators (dropout's): one per data-parallel index, the same on every
tensor-parallel rank of it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch.distributed as dist

#: 2**64 divided by the golden ratio: the data-parallel indices' seeds lie far apart.
_SPREAD = 0x9E3779B97F4A7C15


def random_seed(seed: int, dp_index: int) -> int:
    """The seed of a rank's default random generators, what dropout draws from: the run's
    ``seed`` itself at data-parallel index 0 (one process draws what ``torch.manual_seed``
    of it draws), a different one at each other index (their micro-batches get masks of
    their own), and the same on every tensor-parallel rank of an index, which must draw the
    same masks for the activations they all hold (``minitp.random``)."""
    return (seed + dp_index * _SPREAD) % 2**64


class Mesh:
    """Named dimensions over the ranks of the default process group, outermost first.

    Args:
        dims: ``(name, size)`` pairs, outermost first; the sizes multiply to the world
            size.
        rank, world_size: this process's global rank and the number of ranks (None: the
            default group's; 0 and 1 without a process group).

    Raises:
        ValueError: a size below 1, a repeated name, or sizes that do not multiply to the
            world size.
    """

    def __init__(self, dims: Sequence[tuple[str, int]], *, rank: int | None = None,
                 world_size: int | None = None) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = dist.get_rank() if distributed else 0
        if world_size is None:
            world_size = dist.get_world_size() if distributed else 1
        self.names = tuple(name for name, _ in dims)
        self.shape = tuple(size for _, size in dims)
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"mesh dimensions must have distinct names, got {self.names}")
        for name, size in dims:
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh dimension {name!r} must have a positive integer "
                                 f"size, got {size!r}")
        if math.prod(self.shape) != world_size:
            shape = " x ".join(f"{n} {s}" for n, s in dims)
            raise ValueError(f"a mesh of {shape} needs {math.prod(self.shape)} ranks, "
                             f"there are {world_size}")
        self.rank, self.world_size = rank, world_size
        self.coordinates = self._coordinates_of(rank)
        self._groups: dict[str, dist.ProcessGroup | None] = {}
        self._ranks: dict[str, list[int]] = {}
        for axis, name in enumerate(self.names):
            self._ranks[name] = self._line(self.coordinates, axis)
            self._groups[name] = self._make_groups(axis, distributed)

    @classmethod
    def data_tensor(cls, tp: int, *, rank: int | None = None,
                    world_size: int | None = None) -> Mesh:
        """The trainer's two dimensions: ``(("dp", world / tp), ("tp", tp))``."""
        if world_size is None:
            distributed = dist.is_available() and dist.is_initialized()
            world_size = dist.get_world_size() if distributed else 1
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or world_size % tp:
            raise ValueError(f"tp = {tp!r} does not divide the {world_size} ranks")
        return cls((("dp", world_size // tp), ("tp", tp)), rank=rank, world_size=world_size)

    # ----------------------------------------------------------------- queries
    def size(self, name: str) -> int:
        """The number of ranks along dimension ``name``."""
        return self.shape[self._axis(name)]

    def coordinate(self, name: str) -> int:
        """This rank's index along dimension ``name``."""
        return self.coordinates[self._axis(name)]

    def group(self, name: str) -> dist.ProcessGroup | None:
        """This rank's process group along dimension ``name``: None for the default group
        (the dimension spans every rank, or there is no process group)."""
        self._axis(name)
        return self._groups[name]

    def ranks(self, name: str) -> list[int]:
        """The global ranks of this rank's group along ``name``, in index order."""
        self._axis(name)
        return list(self._ranks[name])

    def describe(self) -> str:
        """``"dp 2 x tp 2"``."""
        return " x ".join(f"{n} {s}" for n, s in zip(self.names, self.shape))

    def __repr__(self) -> str:
        where = ", ".join(f"{n}={c}" for n, c in zip(self.names, self.coordinates))
        return f"Mesh({self.describe()}; rank {self.rank}: {where})"

    # ----------------------------------------------------------------- layout
    def _axis(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise KeyError(f"the mesh has no dimension {name!r} (it has "
                           f"{', '.join(self.names)})") from None

    def _coordinates_of(self, rank: int) -> tuple[int, ...]:
        out = []
        for size in reversed(self.shape):
            out.append(rank % size)
            rank //= size
        return tuple(reversed(out))

    def _rank_of(self, coordinates: Sequence[int]) -> int:
        rank = 0
        for c, size in zip(coordinates, self.shape):
            rank = rank * size + c
        return rank

    def _line(self, coordinates: Sequence[int], axis: int) -> list[int]:
        """The ranks that share every coordinate but ``axis`` with ``coordinates``."""
        at = list(coordinates)
        line = []
        for i in range(self.shape[axis]):
            at[axis] = i
            line.append(self._rank_of(at))
        return line

    def _make_groups(self, axis: int, distributed: bool) -> dist.ProcessGroup | None:
        """Every group along ``axis``, made in the same order on every rank; this rank's
        is returned. None where the dimension spans the world (the default group)."""
        if not distributed or self.shape[axis] == self.world_size:
            return None
        others = [range(s) for i, s in enumerate(self.shape) if i != axis]
        mine = None
        for rest in itertools.product(*others):
            coordinates = list(rest)
            coordinates.insert(axis, 0)
            line = self._line(coordinates, axis)
            group = dist.new_group(line)  # a collective: every rank, every group
            if self.rank in line:
                mine = group
        return mine
