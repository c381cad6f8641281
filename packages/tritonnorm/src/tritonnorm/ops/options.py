"""The switches of tritonnorm's launch path, in one explicit object: ``OPTIONS``.

Everything here has a default that is right for users; tests and tuning scripts change a
field for a while with ``OPTIONS.override(...)``:

    from tritonnorm.ops.options import OPTIONS
    with OPTIONS.override(fold_dw_sum=False):
        ...
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _triton_version() -> tuple[int, int]:
    try:
        import triton

        major, minor = triton.__version__.split(".")[:2]
        return int(major), int(minor)
    except (ImportError, ValueError, AttributeError):  # pragma: no cover - odd installs
        return (0, 0)


def _has_cooperative_launch() -> bool:
    """Whether this Triton can make a CUDA cooperative launch (``launch_cooperative_grid``)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - a Triton without the NVIDIA backend
        return False
    return "launch_cooperative_grid" in getattr(CUDAOptions, "__dataclass_fields__", {})


@dataclass
class KernelOptions:
    """How the launchers pick and launch kernels. One instance: ``OPTIONS``."""

    direct_launch: bool = _triton_version() >= (3, 4) and not _INTERPRET
    """Launch a cached compiled kernel directly instead of through Triton's JIT dispatch,
    which rebinds and rehashes every argument on every call (tens of µs of host time).
    Needs Triton >= 3.4, whose launcher takes every argument in signature order; never
    under the interpreter. Turned off for good if the launcher is not the one we know."""

    cooperative_launch: bool = _has_cooperative_launch()
    """Launch kernels whose programs wait for each other as CUDA cooperative launches, so
    the driver guarantees every program is resident at once or refuses the launch."""

    coop: bool = not _INTERPRET
    """Use the cooperative long-row kernels (one read of x) where a row is longer than one
    block. The interpreter runs programs one at a time, where a wait never ends."""

    fold_dw_sum: bool = True
    """Sum the fused backward's per-program weight-gradient partials at the end of the
    backward kernel itself (its last programs to finish) instead of in a second launch.
    Only in cooperative launches (or the interpreter); shapes in
    ``launch_config.NO_FOLD`` never fold."""

    dw_reduce: str = "triton"
    """How the partials are summed when not folded: "triton" (one column-sum kernel, cast
    included) or "torch" (an ATen sum, plus a cast). Each is bitwise reproducible."""

    spin_ns: int = 200
    """Nanoseconds a program waiting to sum partials sleeps between polls: the programs
    still running need the L2 bandwidth the poll would take."""

    max_fused_block_fwd: int = 32768
    """Longest power-of-two row block the fused forward takes; longer rows go to the
    long-row kernels. Tests lower it to reach those kernels on small rows."""

    max_fused_block_bwd: int = 16384
    """The same for the backward (it holds x and dy, so half the forward's)."""

    loop_chunk: int = 32768
    """Columns per chunk of the two-pass forward at 2-byte dtypes (half at float32): 64 KiB
    per program in flight."""

    loop_chunk_bwd: int = 8192
    """Columns per slice of the two-pass backward."""

    eager_op: bool = False
    """Route eager calls through the registered ``torch.ops.tritonnorm`` operators (as
    compiled code does) instead of the autograd.Function: for tests and benchmarks."""

    def override(self, **changes) -> contextlib.AbstractContextManager:
        """Context manager: set some fields, restore them on exit."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"unknown tritonnorm option(s): {', '.join(sorted(unknown))}")
        return self._override(changes)

    @contextlib.contextmanager
    def _override(self, changes: dict) -> Iterator[KernelOptions]:
        saved = {name: getattr(self, name) for name in changes}
        for name, value in changes.items():
            setattr(self, name, value)
        try:
            yield self
        finally:
            for name, value in saved.items():
                setattr(self, name, value)


OPTIONS = KernelOptions()
