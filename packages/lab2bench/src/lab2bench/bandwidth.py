"""The device's practical memory bandwidth, measured by copying a large tensor."""

from __future__ import annotations

import torch

from lab2bench.devices import resolve_device
from lab2bench.timing import Stats, measure

#: Default copy size: large enough that launch overhead and caches do not matter.
CUDA_COPY_BYTES = 1 << 30
CPU_COPY_BYTES = 64 << 20


def copy_bandwidth_stats(
    device: torch.device | str | None = None,
    nbytes: int | None = None,
    *,
    warmup: int = 3,
    repeats: int = 20,
) -> tuple[float, Stats]:
    """``copy_bandwidth`` that also returns the timing ``Stats``."""
    dev = resolve_device(device)
    if nbytes is None:
        nbytes = CUDA_COPY_BYTES if dev.type == "cuda" else CPU_COPY_BYTES
    if nbytes < 4:
        raise ValueError(f"nbytes must be at least 4, got {nbytes}")
    numel = nbytes // 4
    src = torch.rand(numel, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    stats = measure(lambda: dst.copy_(src), warmup=warmup, repeats=repeats, device=dev,
                    flush_l2=dev.type == "cuda")
    moved = 2 * numel * 4  # every byte is read once and written once
    return moved / stats.median, stats


def copy_bandwidth(
    device: torch.device | str | None = None,
    nbytes: int | None = None,
    *,
    warmup: int = 3,
    repeats: int = 20,
) -> float:
    """Bytes per second moved by ``dst.copy_(src)``, counting the read and the write.

    This is the ceiling a memory-bound kernel can hope for on this device (on an
    H200 about 4.3e12). It uses the median of ``repeats`` timed copies.

    Args:
        device: where to copy (default: CUDA if available, else CPU).
        nbytes: size of the source tensor (default 1 GiB on CUDA, 64 MiB on the CPU).
        warmup: untimed copies first.
        repeats: timed copies.
    """
    bandwidth, _ = copy_bandwidth_stats(device, nbytes, warmup=warmup, repeats=repeats)
    return bandwidth
