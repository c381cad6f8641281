"""Launch configurations: frozen dataclasses, their tuning tables, and the planners that
pick one for a row length.

The tables hold what measured best on an H200 (50,000 rows; the sweeps are
``benchmarks/gpu_check.py --tune*`` and the dated records are in ``docs/``). Keys are
(element size in bytes, BLOCK_H), BLOCK_H being the row length rounded up to a power of
two. Shapes not in a table get a rule of thumb that keeps a few KiB per program.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tritonnorm.ops.options import OPTIONS


def cdiv(a: int, b: int) -> int:
    # Plain integer arithmetic: triton.cdiv is a constexpr_function in recent Triton, and
    # its host-side call costs microseconds on the hot path.
    return (a + b - 1) // b


def next_pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << (int(n) - 1).bit_length())


@dataclass(frozen=True)
class FwdConfig:
    """The fused ("rows") forward."""

    block_r: int
    """Rows per program."""
    num_warps: int
    chunk: int = 0
    """0: x is read once (``_fwd_rows_kernel``). > 0: read twice, ``chunk`` columns at a
    time, the second time from L2 (``_fwd_rows_reread_kernel``): one chunk in registers
    instead of a whole tile lets more programs share an SM."""
    even: bool = False
    """Drop the masks of the re-reading forward when the shape allows it."""


@dataclass(frozen=True)
class BwdConfig:
    """The fused persistent backward."""

    block_r: int
    num_warps: int
    programs_per_sm: int = 1
    row_sum: bool = False
    """Fold each tile's rows into a [BLOCK_H] weight-gradient accumulator (fewer
    registers, so taller tiles fit) instead of keeping the tile's shape."""
    stages: int = 1
    """1: the next tile is prefetched into registers by hand. > 1: Triton's pipeliner
    keeps ``stages - 1`` tiles in flight through shared memory (cp.async), which 16-bit
    rows need: one small tile in flight does not cover the memory latency."""


# The re-read pays where a whole tile in registers is 8-16 KiB per program; 4 rows per
# program at 16-bit x 1024 keeps enough loads in flight without spilling.
FWD_TUNED: dict[tuple[int, int], FwdConfig] = {
    (4, 1024): FwdConfig(1, 4), (4, 2048): FwdConfig(2, 16, 2048),
    (4, 4096): FwdConfig(1, 16, 2048), (4, 8192): FwdConfig(1, 16, 4096, even=True),
    (2, 1024): FwdConfig(4, 8), (2, 2048): FwdConfig(1, 4),
    (2, 4096): FwdConfig(1, 8, 2048), (2, 8192): FwdConfig(1, 16, 4096, even=True),
}
# Pipelining pays in 16-bit at every H; in float32 one register tile is already 16-32 KiB
# at H >= 4096, and the pipeliner's shared memory then costs occupancy.
BWD_TUNED: dict[tuple[int, int], BwdConfig] = {
    (4, 1024): BwdConfig(4, 8, stages=3), (4, 2048): BwdConfig(4, 8),
    (4, 4096): BwdConfig(2, 16), (4, 8192): BwdConfig(1, 8),
    (2, 1024): BwdConfig(2, 4, 2, True, 4), (2, 2048): BwdConfig(4, 4, 1, True, 3),
    (2, 4096): BwdConfig(2, 8, stages=3), (2, 8192): BwdConfig(1, 16, stages=3),
    (4, 16384): BwdConfig(1, 16), (2, 16384): BwdConfig(1, 16),
}
# Shapes whose backward does not fold the weight-gradient sum into itself: at float32 x
# 4096 the kernel runs 16 warps at 128 registers each and the fold's tail measured slower.
NO_FOLD = {(4, 4096)}


@dataclass(frozen=True)
class LoopConfig:
    """The two-pass kernels for rows longer than a fused block."""

    fwd_warps: int = 16
    fwd_programs_per_sm: int = 1
    """One program per SM keeps the rows in flight (about 34 MB at 131,072 columns) inside
    L2, so the second read of a row mostly hits it."""
    bwd_warps: int = 8
    bwd_programs_per_sm: int = 2


LOOP = LoopConfig()


@dataclass(frozen=True)
class CoopConfig:
    """A cooperative long-row kernel: a row split over a group of co-resident programs."""

    block_bytes: int
    """Bytes of a row per program (of x; in the backward, of x and of dy each)."""
    num_warps: int


# A 32 KiB backward slice spills; 16 KiB with 8 warps (16-bit) or 16 (float32) measured best.
COOP_FWD = {2: CoopConfig(32768, 16), 4: CoopConfig(32768, 16)}
COOP_BWD = {2: CoopConfig(16384, 8), 4: CoopConfig(16384, 16)}


@functools.lru_cache(maxsize=1024)
def fwd_config(n_cols: int, elem_size: int) -> tuple[int, FwdConfig]:
    """(BLOCK_H, config) of the fused forward for rows of ``n_cols``."""
    block_h = next_pow2(n_cols, 16)
    cfg = FWD_TUNED.get((elem_size, block_h))
    if cfg is None:
        # Short rows: several per program so each moves a few KiB; long rows: one.
        block_r = max(1, min(64, 4096 // block_h))
        cfg = FwdConfig(block_r, max(1, min(16, block_r * block_h * elem_size // 2048)))
    return block_h, cfg


@functools.lru_cache(maxsize=1024)
def bwd_config(n_cols: int, elem_size: int) -> tuple[int, BwdConfig]:
    """(BLOCK_H, config) of the fused backward for rows of ``n_cols``."""
    block_h = next_pow2(n_cols, 16)
    cfg = BWD_TUNED.get((elem_size, block_h))
    if cfg is None:
        block_r = max(1, min(64, 8192 // block_h))
        cfg = BwdConfig(block_r, max(1, min(16, block_r * block_h // 512)))
    return block_h, cfg


def fwd_is_looped(n_cols: int, forced: bool | None = None) -> bool:
    """Whether the forward needs the long-row kernels (``forced`` overrides)."""
    if forced is not None:
        return forced
    return next_pow2(n_cols, 16) > OPTIONS.max_fused_block_fwd


def bwd_is_looped(n_cols: int, forced: bool | None = None) -> bool:
    if forced is not None:
        return forced
    return next_pow2(n_cols, 16) > OPTIONS.max_fused_block_bwd


@functools.lru_cache(maxsize=1024)  # called on every backward
def fold_layout(n_cols: int, n_part: int, max_summers: int, max_tile: int = 4096
                ) -> tuple[int, int, int]:
    """(rows per load, columns per block, summers) for summing n_part partial rows, in
    tiles of at most ``max_tile`` elements (at least 16 x 8)."""
    summers = max(1, min(n_part, max_summers))
    block_c = min(1024, max(8, next_pow2(cdiv(n_cols, summers))))
    block_p = min(max(16, next_pow2(n_part)), max(16, max_tile // block_c))
    block_c = min(block_c, max(8, max_tile // block_p))
    return block_p, block_c, min(summers, cdiv(n_cols, block_c))


def coop_layout(n_rows: int, n_cols: int, block: int, max_programs: int
                ) -> tuple[int, int] | None:
    """(slices per row, groups) of a cooperative grid of at most ``max_programs``.

    A row of ``n_cols`` takes ``ceil(n_cols / block)`` slices, one program each; the grid
    holds as many whole groups as fit (never more than there are rows). None when one
    group alone would not fit: its programs could not all be resident together.
    """
    n_slices = cdiv(n_cols, block)
    n_groups = min(n_rows, max_programs // n_slices)
    return (n_slices, n_groups) if n_groups >= 1 else None


def clear_plan_caches() -> None:
    """Forget cached configurations (after a tuning table above was changed)."""
    fwd_config.cache_clear()
    bwd_config.cache_clear()
