"""Processes that clean up after themselves: how many threads a CPU rank should use
(:func:`threads_per_rank`), a child that dies with its parent
(:func:`set_parent_death_signal`, Linux), a process told from another that reuses its pid
(:func:`process_start`), and owner records: a temporary folder names the process that made
it (:data:`OWNER_NAME`: pid, host, the pid's start time, :func:`write_owner`), so that a
later process can remove the folders of owners that died (:func:`owner_gone`,
:func:`sweep_stale_folders`).

Standard library only.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lab2sys.files import atomic_write_text

__all__ = ["OWNER_NAME", "owner_gone", "process_start", "set_parent_death_signal",
           "sweep_stale_folders", "threads_per_rank", "write_owner"]

PR_SET_PDEATHSIG = 1
#: The file in a temporary folder that names the process that made it (pid, host, start time).
OWNER_NAME = "owner.json"


# ---------------------------------------------------------------------------- processes
def threads_per_rank(world_size: int) -> int:
    """Intra-op threads each CPU rank should use so that ranks do not oversubscribe the
    cores (on 2 cores with 2 ranks: 1 thread each)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, world_size))


def process_start(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot; Linux), to tell a live
    process from an unrelated one that reuses its pid; None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies; False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


# ----------------------------------------------------------------------- owner records
def write_owner(folder: str | os.PathLike[str], **extra: Any) -> None:
    """Name this process as ``folder``'s owner in :data:`OWNER_NAME`, written atomically,
    with ``extra`` JSON fields (such as a ``kind``, which :func:`owner_gone` can match)."""
    pid = os.getpid()
    record = {**extra, "pid": pid, "host": socket.gethostname(),
              "process_start": process_start(pid)}
    atomic_write_text(os.path.join(folder, OWNER_NAME), json.dumps(record) + "\n")


def owner_gone(info: Any, kind: str | None = None) -> bool:
    """Whether the process an owner record (:func:`write_owner`'s, parsed) names is gone:
    no process has its pid on this host, or one that started at another time (its pid
    reused). False for anything else: a live owner, another host's record, another
    ``kind``'s (when ``kind`` is given), or not such a record."""
    if not isinstance(info, dict) or (kind is not None and info.get("kind") != kind):
        return False
    pid = info.get("pid")
    if info.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive under another user, or cannot tell
        return False
    started, now = info.get("process_start"), process_start(pid)
    return started is not None and now is not None and started != now


def sweep_stale_folders(prefixes: Sequence[str], root: str | None = None,
                        kind: str | None = None) -> list[str]:
    """Remove the folders in ``root`` (default: the temporary folder) whose names start
    with one of ``prefixes`` and whose :data:`OWNER_NAME` names a process that is gone
    (:func:`owner_gone`, of ``kind`` when given); a folder without a readable owner record
    is left, and so is anything that is not a folder. Returns the paths removed.

    Raises:
        TypeError: ``prefixes`` is a single string rather than a sequence of them.
        ValueError: a prefix is empty (it would match every folder in ``root``).
    """
    if isinstance(prefixes, (str, bytes)):
        raise TypeError(f"sweep_stale_folders: prefixes must be a sequence of strings, "
                        f"got the string {prefixes!r}")
    prefixes = tuple(prefixes)
    if not all(isinstance(p, str) and p for p in prefixes):
        raise ValueError(f"sweep_stale_folders: every prefix must be a non-empty string, "
                         f"got {prefixes!r}")
    removed: list[str] = []
    try:
        entries = [e for e in os.scandir(root or tempfile.gettempdir())
                   if e.name.startswith(prefixes)]
    except OSError:
        return removed
    for entry in entries:
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
            info = json.loads(Path(entry.path, OWNER_NAME).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if owner_gone(info, kind):
            shutil.rmtree(entry.path, ignore_errors=True)
            if not os.path.exists(entry.path):
                removed.append(entry.path)
    return removed
