"""Launch configurations of the kernels: the tuning tables and the rules that pick one
for a row length.

The tables were swept on one GPU (docs/benchmarks/README.md, "tuning tables"). The host
code reads a configuration only through the pickers below. Tests and tuning sweeps force
fields with ``override(...)``, which the pickers apply once, when they choose a
configuration; while an override is active no launch plan is recorded or replayed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def cdiv(a: int, b: int) -> int:
    # Plain integer arithmetic: triton.cdiv costs microseconds of host time per call.
    return (a + b - 1) // b


def next_pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << (int(n) - 1).bit_length())


@dataclass(frozen=True)
class Paths:
    """Which kernels serve a row length, and the knobs that are not per shape."""

    looped: bool | None = None
    """True or False forces the long-row kernels on or off; None: by the limits below."""
    max_fused_block_fwd: int = 32768
    """Longest power-of-two row block of the fused forward; longer rows take the long-row
    kernels (tests lower it to reach them on small rows)."""
    max_fused_block_bwd: int = 16384
    """The same for the backward, which holds x and dy."""
    loop_chunk: int = 32768
    """Columns per chunk of the two-pass forward at 2-byte dtypes (half at float32)."""
    loop_chunk_bwd: int = 8192
    """Columns per slice of the two-pass backward."""
    coop: bool = not INTERPRET
    """Use the cooperative long-row kernels (one read of x) where they fit. The
    interpreter runs programs one at a time, where a wait never ends."""
    dw_reduce: str = "triton"
    """How unfolded weight-gradient partials are summed: "triton" (one column-sum kernel)
    or "torch" (an ATen sum and a cast); both bitwise reproducible."""


@dataclass(frozen=True)
class FwdConfig:
    """The fused ("rows") forward."""

    block_r: int
    """Rows per program."""
    num_warps: int
    chunk: int = 0
    """0: x is read once (``fwd_rows_kernel``). > 0: read twice, ``chunk`` columns at a
    time, the second time from L2 (``fwd_rows_reread_kernel``), so that more programs
    share an SM."""
    even: bool = False
    """Drop the re-reading forward's masks where the shape allows it."""


@dataclass(frozen=True)
class BwdConfig:
    """The fused persistent backward."""

    block_r: int
    num_warps: int
    programs_per_sm: int = 1
    row_sum: bool = False
    """Fold each tile's rows into a [BLOCK_H] weight-gradient accumulator (fewer
    registers, so taller tiles fit)."""
    stages: int = 1
    """1: the next tile is prefetched into registers by hand. > 1: Triton's pipeliner
    keeps ``stages - 1`` tiles in flight through shared memory, which 16-bit rows need."""
    prefetch: bool | None = None
    """None: where the loop is not pipelined and two tiles fit (BLOCK_H <= 8192)."""
    fold: bool | None = None
    """May the weight-gradient sum be folded into the kernel (``_machinery``)? None: unless
    the shape is in ``NO_FOLD``."""
    fold_tile: int | None = None
    """Elements a summer loads at once in the folded sum; None: min(4096, 1024 x warps)."""
    spin_ns: int = 200
    """Nanoseconds a program waiting to sum partials sleeps between polls."""


@dataclass(frozen=True)
class LongConfig:
    """The two-pass kernels for rows longer than a fused block."""

    chunk: int
    num_warps: int
    programs_per_sm: int


@dataclass(frozen=True)
class CoopConfig:
    """A cooperative long-row kernel: a row split over a group of co-resident programs."""

    block_bytes: int
    """Bytes of a row per program (of x; in the backward, of x and of dy each)."""
    num_warps: int


# (element size, BLOCK_H) -> config. The re-read pays where a whole tile in registers is
# 8-16 KiB per program.
FWD_TUNED: dict[tuple[int, int], FwdConfig] = {
    (4, 1024): FwdConfig(1, 4), (4, 2048): FwdConfig(2, 16, 2048),
    (4, 4096): FwdConfig(1, 16, 2048), (4, 8192): FwdConfig(1, 16, 4096, even=True),
    (2, 1024): FwdConfig(4, 8), (2, 2048): FwdConfig(1, 4),
    (2, 4096): FwdConfig(1, 8, 2048), (2, 8192): FwdConfig(1, 16, 4096, even=True),
}
# Pipelining pays in 16-bit at every H; in float32 a register tile is already 16-32 KiB
# at H >= 4096, and the pipeliner's shared memory then costs occupancy.
BWD_TUNED: dict[tuple[int, int], BwdConfig] = {
    (4, 1024): BwdConfig(4, 8, stages=3), (4, 2048): BwdConfig(4, 8),
    (4, 4096): BwdConfig(2, 16), (4, 8192): BwdConfig(1, 8),
    (2, 1024): BwdConfig(2, 4, 2, True, 4), (2, 2048): BwdConfig(4, 4, 1, True, 3),
    (2, 4096): BwdConfig(2, 8, stages=3), (2, 8192): BwdConfig(1, 16, stages=3),
    (4, 16384): BwdConfig(1, 16), (2, 16384): BwdConfig(1, 16),
}
# Shapes whose backward does not fold its weight-gradient sum: at float32 x 4096 the
# kernel runs 16 warps at 128 registers each and the fold's tail measured slower.
NO_FOLD = {(4, 4096)}
# One program per SM keeps the rows in flight inside L2 for the forward's second read.
LONG_FWD = LongConfig(chunk=0, num_warps=16, programs_per_sm=1)
LONG_BWD = LongConfig(chunk=0, num_warps=8, programs_per_sm=2)
# A 32 KiB backward slice spills; 16 KiB with 8 warps (16-bit) or 16 (float32) was best.
COOP_FWD = {2: CoopConfig(32768, 16), 4: CoopConfig(32768, 16)}
COOP_BWD = {2: CoopConfig(16384, 8), 4: CoopConfig(16384, 16)}
COOP_DEFAULT = CoopConfig(16384, 8)

# ---------------------------------------------------------------------------- overrides

#: The fields ``override`` forces now (empty in product use).
OVERRIDES: dict = {}
_FIELDS = {f.name for cls in (Paths, FwdConfig, BwdConfig, LongConfig) for f in
           dataclasses.fields(cls)} | {"coop_block", "coop_warps"}


@contextlib.contextmanager
def override(**fields) -> Iterator[None]:
    """Force launch-configuration fields (``block_r=4``, ``chunk=32``, ``looped=True``,
    ``max_fused_block_fwd=16``, ``coop_block=128``...) for the calls inside the block;
    each applies to whichever configuration has a field of that name."""
    unknown = set(fields) - _FIELDS
    if unknown:
        raise TypeError(f"unknown launch-configuration field(s): {', '.join(sorted(unknown))}")
    saved = dict(OVERRIDES)
    OVERRIDES.update(fields)
    try:
        yield
    finally:
        OVERRIDES.clear()
        OVERRIDES.update(saved)


def overridden() -> bool:
    """Whether a configuration is forced now (launch plans then stay off)."""
    return bool(OVERRIDES)


def _forced(config):
    """``config`` with the overrides that name its fields."""
    if not OVERRIDES:
        return config
    names = {f.name for f in dataclasses.fields(config)}
    changes = {k: v for k, v in OVERRIDES.items() if k in names}
    return dataclasses.replace(config, **changes) if changes else config


# ---------------------------------------------------------------------------- pickers

_PATHS = Paths()


def paths() -> Paths:
    return _forced(_PATHS)


def fwd_is_looped(n_cols: int, p: Paths) -> bool:
    """Whether the forward needs the long-row kernels."""
    return p.looped if p.looped is not None else next_pow2(n_cols, 16) > p.max_fused_block_fwd


def bwd_is_looped(n_cols: int, p: Paths) -> bool:
    return p.looped if p.looped is not None else next_pow2(n_cols, 16) > p.max_fused_block_bwd


def _block_h(n_cols: int) -> int:
    return next_pow2(n_cols, 16)


@functools.lru_cache(maxsize=1024)
def _fwd_table(n_cols: int, elem_size: int) -> FwdConfig:
    cfg = FWD_TUNED.get((elem_size, _block_h(n_cols)))
    if cfg is None:  # short rows: several per program so each moves a few KiB
        block_r = max(1, min(64, 4096 // _block_h(n_cols)))
        cfg = FwdConfig(block_r, max(1, min(16, block_r * _block_h(n_cols) * elem_size // 2048)))
    return cfg


def fwd_config(n_cols: int, elem_size: int) -> tuple[int, FwdConfig]:
    """(BLOCK_H, config) of the fused forward for rows of ``n_cols``."""
    block_h = _block_h(n_cols)
    cfg = _forced(_fwd_table(n_cols, elem_size))
    return block_h, (cfg if cfg.chunk <= block_h else dataclasses.replace(cfg, chunk=block_h))


@functools.lru_cache(maxsize=1024)
def _bwd_table(n_cols: int, elem_size: int) -> BwdConfig:
    block_h = _block_h(n_cols)
    cfg = BWD_TUNED.get((elem_size, block_h))
    if cfg is None:
        block_r = max(1, min(64, 8192 // block_h))
        cfg = BwdConfig(block_r, max(1, min(16, block_r * block_h // 512)))
    return cfg


@functools.lru_cache(maxsize=1024)
def _resolved(cfg: BwdConfig, elem_size: int, block_h: int) -> BwdConfig:
    """``cfg`` with the fields left None filled in by their rules."""
    return dataclasses.replace(
        cfg,
        prefetch=cfg.stages == 1 and block_h <= 8192 if cfg.prefetch is None else cfg.prefetch,
        fold=(elem_size, block_h) not in NO_FOLD if cfg.fold is None else cfg.fold,
        fold_tile=min(4096, 1024 * cfg.num_warps) if cfg.fold_tile is None else cfg.fold_tile)


def bwd_config(n_cols: int, elem_size: int) -> tuple[int, BwdConfig]:
    """(BLOCK_H, config) of the fused backward for rows of ``n_cols``."""
    block_h = _block_h(n_cols)
    return block_h, _resolved(_forced(_bwd_table(n_cols, elem_size)), elem_size, block_h)


def long_config(n_cols: int, elem_size: int, backward: bool, p: Paths) -> LongConfig:
    """The two-pass kernels' configuration for rows of ``n_cols``."""
    if backward:
        cfg = dataclasses.replace(LONG_BWD, chunk=p.loop_chunk_bwd)
    else:
        cfg = dataclasses.replace(LONG_FWD, chunk=max(1, p.loop_chunk * 2 // elem_size))
    cfg = _forced(cfg)
    return dataclasses.replace(cfg, chunk=min(cfg.chunk, _block_h(n_cols)))


def coop_config(elem_size: int, backward: bool) -> tuple[int, int]:
    """(columns per program, warps) of a cooperative long-row kernel."""
    cfg = (COOP_BWD if backward else COOP_FWD).get(elem_size, COOP_DEFAULT)
    return (OVERRIDES.get("coop_block", cfg.block_bytes // elem_size),
            OVERRIDES.get("coop_warps", cfg.num_warps))


def coop_plan(n_rows: int, n_cols: int, elem_size: int, on_gpu: bool, max_programs: int,
              coop: bool, backward: bool) -> tuple[int, int, int, int] | None:
    """(columns per program, slices per row, groups, num_warps) of a cooperative long-row
    launch, or None where the two-pass kernels serve: ``coop`` off, on the interpreter
    where a row takes more than one slice (programs that wait for each other cannot run
    one at a time), or where a row needs more slices than the GPU runs programs at once."""
    if not coop:
        return None
    block, num_warps = coop_config(elem_size, backward)
    if not on_gpu and n_cols > block:
        return None
    layout = coop_layout(n_rows, n_cols, block, max_programs)
    return None if layout is None else (block, *layout, num_warps)


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
