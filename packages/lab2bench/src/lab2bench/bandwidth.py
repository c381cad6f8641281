"""The device's practical memory bandwidth, measured by copying a large tensor."""

from __future__ import annotations

import torch

from lab2bench.devices import resolve_device
from lab2bench.timing import measure

#: Default copy size: large enough that launch overhead and caches do not matter.
CUDA_COPY_BYTES = 1 << 30
CPU_COPY_BYTES = 64 << 20


def copy_bandwidth(device: torch.device | str | None = None, nbytes: int | None = None,
                   *, warmup: int = 3, repeats: int = 20) -> float:
    """Bytes per second moved by ``dst.copy_(src)``, counting the read and the write (the
    median of ``repeats`` timed copies, L2 flushed on CUDA).

    This is the ceiling a memory-bound kernel can hope for on this device (figures in
    ``docs/benchmarks/``). ``device``: default CUDA if available, else CPU; ``nbytes``: the source
    tensor's size (default 1 GiB on CUDA, 64 MiB on the CPU).
    """
    dev = resolve_device(device)
    if nbytes is None:
        nbytes = CUDA_COPY_BYTES if dev.type == "cuda" else CPU_COPY_BYTES
    if nbytes < 4:
        raise ValueError(f"nbytes must be at least 4, got {nbytes}")
    src = torch.rand(nbytes // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    stats = measure(lambda: dst.copy_(src), warmup=warmup, repeats=repeats, device=dev,
                    flush_l2=dev.type == "cuda")
    return 2 * src.numel() * 4 / stats.median  # every byte read once, written once
