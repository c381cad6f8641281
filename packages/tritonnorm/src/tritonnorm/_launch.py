"""How a kernel of ``kernels`` is launched: its arguments by name, and Triton's own launch.

Every kernel takes its runtime arguments first and its constexprs last. Each has an
``*Args`` and a ``*Consts`` NamedTuple here whose fields are its parameters' names, in
order (``tests/test_launch_signatures.py`` checks them against ``kernels.py``), so a
launch reads ``launch(kernel, grid, FwdRowsArgs(X=..., ...), FwdRowsConsts(...), warps)``.
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

import torch

try:  # Triton is optional: without it (or on a platform it lacks) CUDA tensors use PyTorch.
    import tritonnorm.kernels as kernels

    HAS_TRITON = True
    TRITON_IMPORT_ERROR: ImportError | None = None
except ImportError as _err:  # pragma: no cover - depends on the environment
    kernels = None
    HAS_TRITON = False
    TRITON_IMPORT_ERROR = _err

T = Any  # a tensor, or (in a recorded launch plan) its address


def triton_unavailable_error() -> ImportError:
    """The error to raise when the Triton kernels are asked for but cannot be imported."""
    hint = ("install numpy too (pip install 'tritonnorm[interpret]'): Triton's interpreter "
            "needs it" if "numpy" in str(TRITON_IMPORT_ERROR) else
            "install triton (it comes with torch on Linux)")
    return ImportError(f"tritonnorm's Triton kernels cannot be imported "
                       f"({TRITON_IMPORT_ERROR}); {hint}")


def _has_cooperative_launch() -> bool:
    """Whether this Triton can make a CUDA cooperative launch (``launch_cooperative_grid``)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - a Triton without the NVIDIA backend
        return False
    return "launch_cooperative_grid" in getattr(CUDAOptions, "__dataclass_fields__", {})


#: Kernels whose programs wait for each other launch cooperatively where Triton can: the
#: driver then guarantees that every program is resident at once, or refuses the launch.
COOPERATIVE = _has_cooperative_launch()


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def n_programs(x: torch.Tensor, per_sm: int) -> int:
    """Programs in a persistent grid: ``per_sm`` per SM of x's GPU, 3 on the interpreter
    (which runs them one by one; 3 still exercises the partial sums)."""
    index = x.get_device()  # -1 for a CPU tensor
    return per_sm * sm_count(index) if index >= 0 else 3


def jit_options(num_warps: int, cooperative: bool) -> dict:
    if cooperative and COOPERATIVE:
        return {"num_warps": num_warps, "launch_cooperative_grid": True}
    return {"num_warps": num_warps}


def jit(kernel, grid: tuple[int, int, int], args: tuple, consts: tuple, num_warps: int,
        cooperative: bool = False) -> None:
    """Launch ``kernel`` through Triton's JIT (which binds and hashes every argument)."""
    kernel[grid](*args, *consts, **jit_options(num_warps, cooperative))


def traceable(kernel, grid: tuple[int, int, int], args: tuple, consts: tuple,
              num_warps: int, cooperative: bool = False) -> None:
    """Launch through ``torch.library.wrap_triton`` (a ``triton_op``'s body). Never
    cooperative: Inductor's launcher has no such option, so nothing on this path waits
    for other programs."""
    if cooperative:
        raise ValueError("a traceable launch cannot be cooperative")
    from torch.library import wrap_triton

    wrap_triton(kernel)[grid](*args, *consts, num_warps=num_warps)


class Mode(NamedTuple):
    """The three constexprs every kernel takes last."""

    HAS_W: bool
    OFFSET: float
    LLAMA: bool


class FwdRowsArgs(NamedTuple):
    X: T
    R: T
    W: T
    Y: T
    S: T
    RSTD: T
    n_rows: int
    n_cols: int
    stride_x: int
    stride_r: int
    stride_y: int
    eps: float


class FwdRowsConsts(NamedTuple):
    BLOCK_R: int
    BLOCK_H: int
    STORE_RSTD: bool
    HAS_RES: bool
    HAS_W: bool
    OFFSET: float
    LLAMA: bool


class FwdRereadArgs(NamedTuple):
    X: T
    W: T
    Y: T
    RSTD: T
    n_rows: int
    n_cols: int
    stride_x: int
    stride_y: int
    eps: float


class FwdRereadConsts(NamedTuple):
    BLOCK_R: int
    CHUNK: int
    EVEN: bool
    STORE_RSTD: bool
    HAS_W: bool
    OFFSET: float
    LLAMA: bool


class BwdRowsArgs(NamedTuple):
    X: T
    W: T
    DY: T
    RSTD: T
    DX: T
    DW_PART: T
    DS: T
    DR: T
    DW: T
    COUNTER: T
    n_rows: int
    n_cols: int
    stride_x: int
    stride_dy: int
    stride_dx: int
    stride_ds: int
    n_red: int


class BwdRowsConsts(NamedTuple):
    BLOCK_R: int
    BLOCK_H: int
    HAS_DX: bool
    HAS_DW: bool
    PREFETCH: bool
    ROW_SUM: bool
    STAGES: int
    HAS_DS: bool
    HAS_DR: bool
    FOLD: bool
    RED_P: int
    RED_C: int
    SPIN_NS: int
    HAS_W: bool
    OFFSET: float
    LLAMA: bool


class SumPartialsArgs(NamedTuple):
    PART: T
    OUT: T
    n_part: int
    n_cols: int


class SumPartialsConsts(NamedTuple):
    BLOCK_P: int
    BLOCK_C: int


# The looped forward kernel takes the reread one's arguments (its constants differ).
FwdLoopedArgs = FwdRereadArgs


class FwdLoopedConsts(NamedTuple):
    CHUNK: int
    HAS_W: bool
    OFFSET: float
    LLAMA: bool


class BwdSlicesArgs(NamedTuple):
    X: T
    W: T
    DY: T
    RSTD: T
    DOT_PART: T
    DW_PART: T
    n_rows: int
    n_cols: int
    stride_x: int
    stride_dy: int


class BwdSlicesConsts(NamedTuple):
    BLOCK_H: int
    HAS_DX: bool
    HAS_DW: bool
    HAS_W: bool
    OFFSET: float
    LLAMA: bool


class BwdDxLoopedArgs(NamedTuple):
    X: T
    W: T
    DY: T
    RSTD: T
    DOT_PART: T
    DX: T
    n_rows: int
    n_cols: int
    n_slices: int
    stride_x: int
    stride_dy: int
    stride_dx: int


class BwdDxLoopedConsts(NamedTuple):
    BLOCK_H: int
    BLOCK_S: int
    HAS_W: bool
    OFFSET: float
    LLAMA: bool


class FwdCoopArgs(NamedTuple):
    X: T
    W: T
    Y: T
    RSTD: T
    SLOTS: T
    n_rows: int
    n_cols: int
    n_slices: int
    stride_x: int
    stride_y: int
    eps: float


class FwdCoopConsts(NamedTuple):
    BLOCK_H: int
    BLOCK_S: int
    HAS_W: bool
    OFFSET: float
    LLAMA: bool


class BwdCoopArgs(NamedTuple):
    X: T
    W: T
    DY: T
    RSTD: T
    SLOTS: T
    DX: T
    DW_PART: T
    n_rows: int
    n_cols: int
    n_slices: int
    stride_x: int
    stride_dy: int
    stride_dx: int


class BwdCoopConsts(NamedTuple):
    BLOCK_H: int
    BLOCK_S: int
    HAS_DX: bool
    HAS_DW: bool
    HAS_W: bool
    OFFSET: float
    LLAMA: bool


#: kernel name in ``kernels`` -> (its Args, its Consts): what the signature test checks.
SIGNATURES = {
    "fwd_rows_kernel": (FwdRowsArgs, FwdRowsConsts),
    "fwd_rows_reread_kernel": (FwdRereadArgs, FwdRereadConsts),
    "bwd_rows_kernel": (BwdRowsArgs, BwdRowsConsts),
    "sum_partials_kernel": (SumPartialsArgs, SumPartialsConsts),
    "fwd_looped_kernel": (FwdLoopedArgs, FwdLoopedConsts),
    "bwd_slices_kernel": (BwdSlicesArgs, BwdSlicesConsts),
    "bwd_dx_looped_kernel": (BwdDxLoopedArgs, BwdDxLoopedConsts),
    "fwd_coop_kernel": (FwdCoopArgs, FwdCoopConsts),
    "bwd_coop_kernel": (BwdCoopArgs, BwdCoopConsts),
}
