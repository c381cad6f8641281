"""Launching the kernels with as little host time as a Python call can cost.

``kernel[grid](...)`` makes Triton bind the arguments, compute their specialisation key
and look the compiled kernel up on every call: tens of microseconds, which at small sizes
is longer than the kernel. After the first launch of a specialisation, ``launch`` keeps
the CompiledKernel Triton returned and calls its bare launcher. The cache key holds what
Triton specialises on: the kernel, the device, num_warps, the constexpr values, each
tensor's dtype and 16-byte alignment, and each int's ==1, divisible-by-16 and fits-int32
properties (floats are not specialised).

``launch_traceable`` is the other path: it goes through ``torch.library.wrap_triton``, so
that under ``torch.compile`` Inductor sees the kernel and launches it from generated code
(and captures it in CUDA graphs).
"""

from __future__ import annotations

import functools

import torch

from tritonnorm.ops.options import OPTIONS, _triton_version

_COMPILED: dict = {}
_MAX_COMPILED = 4096


def _arg_key(a):
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, bool):
        return bool, a
    if isinstance(a, int):
        return a == 1, a % 16 == 0, -0x80000000 <= a <= 0x7FFFFFFF
    return type(a)


def _direct_args(args: tuple) -> tuple[tuple, list]:
    """(cache key of ``args``, ``args`` with each tensor replaced by its address).

    The launcher given plain addresses skips its per-pointer driver query; the callers
    allocate every tensor on the launch's device, or check that it is there.
    """
    key, out = [], []
    for a in args:
        if isinstance(a, torch.Tensor):
            ptr = a.data_ptr()  # the same key as _arg_key's, without a second call
            key.append((a.dtype, ptr % 16 == 0))
            out.append(ptr)
        else:
            key.append(_arg_key(a))
            out.append(a)
    return tuple(key), out


def _launch_hooks():
    """Triton's launch hook chains (enter, exit), or None where this Triton has none."""
    try:
        from triton import knobs
        return knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    except (ImportError, AttributeError):  # pragma: no cover - an older Triton
        return None


# Triton >= 3.6 (checked on 3.6 and 3.9): ``CompiledKernel.run(gx, gy, gz, stream,
# function, packed_metadata, launch_metadata, enter_hook, exit_hook, *args)`` is what
# ``compiled[grid](...)`` calls after building a closure and launch metadata. Calling it
# directly is only right while no launch hook is registered (a profiler such as Proton
# registers one; then the full path runs).
_HOOKS = _launch_hooks() if _triton_version() >= (3, 6) else None


def _hooks_idle() -> bool:
    return _HOOKS is not None and not (_HOOKS[0].calls or _HOOKS[1].calls)


def _jit_options(num_warps: int, cooperative: bool) -> dict:
    if cooperative:
        return {"num_warps": num_warps, "launch_cooperative_grid": True}
    return {"num_warps": num_warps}


def current_stream(device_index: int) -> int:
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream  # pragma: no cover


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launch(kernel, grid: tuple[int, int, int], args: tuple, consts: tuple, num_warps: int,
           cooperative: bool = False):
    """Launch ``kernel`` over ``grid`` with runtime ``args`` then constexpr ``consts``.

    Every kernel of this package takes its runtime arguments first and its constexprs
    last, so ``args + consts`` is its whole positional signature. ``cooperative`` asks
    for a CUDA cooperative launch where Triton offers one.
    """
    cooperative = cooperative and OPTIONS.cooperative_launch
    if not OPTIONS.direct_launch:
        kernel[grid](*args, *consts, **_jit_options(num_warps, cooperative))
        return
    # id() of the kernel rather than its hash (kernels are module globals that live as
    # long as the process); the first tensor's device and the raw current stream, which
    # is what Triton itself would read.
    device = args[0].get_device()
    spec, direct = _direct_args(args)
    key = (id(kernel), device, num_warps, cooperative, consts, spec)
    compiled = _COMPILED.get(key)
    if compiled is not None:
        stream = current_stream(device)
        try:
            if _hooks_idle():
                compiled.run(grid[0], grid[1], grid[2], stream, compiled.function,
                             compiled.packed_metadata, None, None, None, *direct, *consts)
            else:
                compiled[grid](*args, *consts, stream=stream)
            return compiled
        except (TypeError, SystemError, AttributeError):  # pragma: no cover - another Triton
            OPTIONS.direct_launch = False
            _COMPILED.clear()
            kernel[grid](*args, *consts, **_jit_options(num_warps, cooperative))
            return
    # The first launch goes through the JIT on the tensors' device (the compiled kernel is
    # loaded there, and the direct path launches it on that device's stream).
    with torch.cuda.device(device):
        compiled = kernel[grid](*args, *consts, **_jit_options(num_warps, cooperative))
    if compiled is None or not hasattr(compiled, "function"):
        OPTIONS.direct_launch = False  # not the Triton we know: always go through the JIT
        return
    if len(_COMPILED) >= _MAX_COMPILED:
        _COMPILED.clear()
    _COMPILED[key] = compiled
    return None


class LaunchCache:
    """Launches whose every argument but the tensors' addresses follows from a key.

    The launchers key a call by what fixes the grid and the scalar arguments (shapes,
    dtypes, devices, flags); once a launch through ``launch`` has been recorded, a call
    with the same key costs the addresses, one alignment test and Triton's bare launcher:
    no argument walk, no specialisation key. Only launches whose tensors were all 16-byte
    aligned are recorded; a call whose tensors are not takes the full path.

    A plan is ``(compiled, grid, tail, n_ptrs, extra)``: the kernel, its grid, its scalar
    and constexpr arguments, how many addresses come first, and whatever else the caller
    recorded with it (the forward: a tensor to allocate its per-row statistic like).
    """

    def __init__(self) -> None:
        self._plans: dict = {}

    def get(self, key):
        """The recorded plan for ``key``, or None where there is none or it cannot be
        used now (direct launches off, a launch hook registered)."""
        if not OPTIONS.direct_launch or not _hooks_idle():
            return None
        return self._plans.get(key)

    @staticmethod
    def launch(plan, stream: int, ptrs: tuple) -> bool:
        """Launch ``plan`` on the raw CUDA ``stream`` with these addresses (the kernel's
        first arguments, in order); False, launching nothing, when one of them is not
        16-byte aligned."""
        align = 0
        for p in ptrs:
            align |= p
        if align & 15:
            return False
        compiled, grid, tail = plan[0], plan[1], plan[2]
        compiled.run(grid[0], grid[1], grid[2], stream, compiled.function,
                     compiled.packed_metadata, None, None, None, *ptrs, *tail)
        return True

    def record(self, key, compiled, grid: tuple, args: tuple, n_ptrs: int,
               consts: tuple, extra=None) -> None:
        """Remember a launch that just ran: ``compiled`` as ``launch`` returned it, its
        arguments, of which the first ``n_ptrs`` are the tensors, and ``extra``."""
        if compiled is None or any(a.data_ptr() & 15 for a in args[:n_ptrs]):
            return
        if len(self._plans) >= _MAX_COMPILED:
            self._plans.clear()
        self._plans[key] = (compiled, grid, (*args[n_ptrs:], *consts), n_ptrs, extra)


def launch_traceable(kernel, grid: tuple[int, int, int], args: tuple, consts: tuple,
                     num_warps: int, cooperative: bool = False) -> None:
    """``launch`` through ``torch.library.wrap_triton`` (a ``triton_op``'s body).

    Never cooperative: Inductor's launcher has no such option, so callers on this path
    never fold (nothing waits for other programs).
    """
    if cooperative:
        raise ValueError("a traceable launch cannot be cooperative")
    from torch.library import wrap_triton

    wrap_triton(kernel)[grid](*args, *consts, num_warps=num_warps)
