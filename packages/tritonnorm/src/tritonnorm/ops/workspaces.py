"""Scratch memory the backward kernels need, kept per (device, stream) for eager launches.

An allocation costs several µs of host time, the whole cost of a small backward, so eager
launches reuse buffers. Launches on one stream run one after another, so they may share;
launches on different streams may overlap, so they never do. A launch captured into a CUDA
graph (or traced by ``torch.compile``) never touches these: it gets memory of its own.
"""

from __future__ import annotations

import torch

from tritonnorm.ops.launcher import current_stream

# The folded weight-gradient sum's counters: two int32 (an arrival count, zero on entry and
# reset by the last arrival, and a generation word), padded to 16 bytes.
_COUNTERS: dict = {}
# Counters for launches captured into CUDA graphs: a graph may be replayed on any stream
# alongside anything, so each captured launch takes a pair of its own from a pool zeroed
# before any capture, or, when the pool is used up or was never made, one zeroed in the graph.
_COUNTER_POOLS: dict = {}
COUNTER_POOL_SIZE = 1024
# The fused backward's [programs, H] float32 partial weight gradients: they live only
# until the dweight sum that follows on the same stream. The latest shape is kept (SMs x
# programs per SM x H x 4 bytes: a few MB at most).
_PARTIALS: dict = {}


def _pick_capture_check():
    raw = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
    return raw if raw is not None else torch.cuda.is_current_stream_capturing


# Looked up once: the check runs on every eager backward.
_capturing = _pick_capture_check()


def eager_stream(x: torch.Tensor) -> tuple[int, int] | None:
    """(device, current stream) of an eager launch on ``x``'s GPU, the key of what
    launches on one stream share; None on the CPU or while a CUDA graph is captured."""
    device = x.get_device()
    if device < 0 or _capturing():
        return None
    return device, current_stream(device)


def eager_scratch(x: torch.Tensor, n_prog: int, n_cols: int
                  ) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """(raw stream, partials buffer, zeroed counters) of an eager folded backward on
    ``x``'s GPU, with one stream query for all three; None on the CPU or while a CUDA
    graph is captured (the launch then needs memory of its own)."""
    key = eager_stream(x)
    if key is None:
        return None
    counter = _COUNTERS.get(key)
    buf = _PARTIALS.get(key)
    if counter is None or buf is None or buf.shape[0] != n_prog or buf.shape[1] != n_cols:
        return key[1], partials_buffer(x, n_prog, n_cols), fold_counter(x)
    return key[1], buf, counter


def fold_counter(x: torch.Tensor) -> torch.Tensor:
    """Zeroed int32 counters for a folded backward launch on ``x``'s device."""
    key = eager_stream(x)
    if key is None:
        device = x.get_device()
        if device < 0:
            return torch.zeros(4, dtype=torch.int32)
        pool = _COUNTER_POOLS.get(device)  # capturing a CUDA graph
        if not pool:
            return torch.zeros(4, dtype=torch.int32, device=x.device)
        return pool.pop()
    device = key[0]
    counter = _COUNTERS.get(key)
    if counter is None:
        if device not in _COUNTER_POOLS:
            block = torch.zeros((COUNTER_POOL_SIZE, 4), dtype=torch.int32, device=x.device)
            _COUNTER_POOLS[device] = list(block.unbind(0))
        counter = _COUNTERS[key] = torch.zeros(4, dtype=torch.int32, device=x.device)
    return counter


def partials_buffer(x: torch.Tensor, n_prog: int, n_cols: int) -> torch.Tensor:
    """An uninitialised float32 [n_prog, n_cols] buffer for the fused backward's partials."""
    key = eager_stream(x)
    if key is None:
        return x.new_empty((n_prog, n_cols), dtype=torch.float32)
    buf = _PARTIALS.get(key)
    if buf is None or buf.shape[0] != n_prog or buf.shape[1] != n_cols:
        buf = _PARTIALS[key] = x.new_empty((n_prog, n_cols), dtype=torch.float32)
    return buf
