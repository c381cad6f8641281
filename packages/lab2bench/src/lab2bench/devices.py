"""Which device a measurement runs on, and how to wait for it."""

from __future__ import annotations

import torch


def resolve_device(device: torch.device | str | None = None) -> torch.device:
    """Turn a device argument into a ``torch.device``.

    Args:
        device: a ``torch.device``, a string such as ``"cuda:1"``, or None for the
            default: CUDA (the current device) when it is available, else the CPU.

    Raises:
        ValueError: for a string torch does not parse as a device.
        RuntimeError: when CUDA is asked for but not available.
    """
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError as err:
            raise ValueError(f"not a device: {device!r} ({err})") from None
    if not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device, a string or None, got {type(device)}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {device} asked for, but CUDA is not available here")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def synchronize(device: torch.device | str) -> None:
    """Wait until every kernel queued on ``device`` has finished (no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
