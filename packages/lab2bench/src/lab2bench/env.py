"""Where a measurement was taken: device, library versions, git commit, host."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_VERSIONED = ("torch", "triton", "numpy", "lab2bench", "tritonnorm", "liger-kernel")


def _version(dist: str) -> str | None:
    # Read from the installed metadata: importing triton or liger just to ask would be slow.
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit(path: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """``{"commit": sha, "dirty": bool}`` for the git checkout holding ``path`` (default:
    the working directory), or None outside a checkout or without git."""
    cwd = Path(path) if path is not None else Path.cwd()
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True,
                             text=True, timeout=5, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                cwd=cwd, capture_output=True, text=True, timeout=10,
                                check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": sha, "dirty": bool(status.strip())}


@functools.lru_cache(maxsize=1)
def _static_info() -> dict[str, Any]:
    import torch

    versions = {name: _version(name) for name in _VERSIONED}
    versions["python"] = platform.python_version()
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "versions": versions,
        "cuda_version": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "git": git_commit(),
    }
    if info["gpu_count"]:
        info["gpu_names"] = [torch.cuda.get_device_name(i) for i in range(info["gpu_count"])]
    return info


def device_name(device: torch.device | str | None = None) -> str:
    """A readable name of the device: the GPU's model, or the CPU's."""
    import torch

    dev = torch.device(device) if device is not None else None
    if dev is None:
        dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    name = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return name or platform.machine() or "cpu"


def env_info(device: torch.device | str | None = None) -> dict[str, Any]:
    """Describe the machine and software a measurement ran on.

    Args:
        device: the device measured (default: CUDA if available, else CPU).

    Returns:
        A JSON-ready dict: ``device``, ``device_name``, ``hostname``, ``platform``,
        ``cpu_count``, ``torch_threads``, ``versions`` (python, torch, triton, numpy,
        lab2bench, tritonnorm, liger-kernel; None when not installed),
        ``cuda_version``, ``gpu_count``, ``gpu_names``, ``git`` (commit and dirty
        flag of the working directory's checkout, or None).
    """
    import torch

    dev = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    info = dict(_static_info())
    info["device"] = str(dev)
    info["device_name"] = device_name(dev)
    info["torch_threads"] = torch.get_num_threads()
    return info
