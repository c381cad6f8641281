"""Internal: the process and file helpers that lab2bench and the trainer's runtime
(``lab2-train``) share, one copy of each. Standard library only, so that importing it
imports neither torch nor anything of lab2bench's measurement; not part of lab2bench's
public API (``lab2bench.atomic_write`` and the launcher in :mod:`lab2bench.ranks` are).

* :func:`atomic_write` and its text and bytes forms: a reader, or a crash, sees the old
  file or the new one, never half of it; only an absent target or a regular file is
  replaced (:class:`NotARegularFile`), and the temporary name fits wherever the target's
  does (:func:`temp_name`);
* :func:`threads_per_rank`: intra-op threads for CPU ranks sharing the cores;
* :func:`set_parent_death_signal`: a child that dies with its parent (Linux);
* owner records: a temporary folder names the launcher that made it (:data:`OWNER_NAME`:
  pid, host, the pid's start time), so that a later launcher can remove the folders of
  launchers that died (:func:`sweep_stale_folders`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

PR_SET_PDEATHSIG = 1
#: The file in a launcher's temporary folder that names the launcher (pid, host, start time).
OWNER_NAME = "owner.json"


# --------------------------------------------------------------------------- processes
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
def write_owner(folder: str, **extra: Any) -> None:
    """Name this process as ``folder``'s owner in :data:`OWNER_NAME` (with ``extra``
    fields, such as a ``kind``)."""
    pid = os.getpid()
    record = {**extra, "pid": pid, "host": socket.gethostname(),
              "process_start": process_start(pid)}
    atomic_write_text(os.path.join(folder, OWNER_NAME), json.dumps(record) + "\n")


def owner_gone(info: Any, kind: str | None = None) -> bool:
    """Whether the launcher an owner record names is gone (on this host); False for
    anything else (another host's, another ``kind``'s, or not such a record)."""
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
    with one of ``prefixes`` and whose :data:`OWNER_NAME` names a launcher that is gone
    (:func:`owner_gone`); a folder without a readable owner record is left. Returns the
    paths removed."""
    removed: list[str] = []
    try:
        entries = [e for e in os.scandir(root or tempfile.gettempdir())
                   if e.name.startswith(tuple(prefixes))]
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


# ----------------------------------------------------------------------- atomic writes
def _fsync_dir(path: Path) -> None:
    """Flush a folder's entries (a rename into it) to disk, where the platform can."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class NotARegularFile(OSError):
    """An atomic write's target is a folder, a device, a FIFO or a socket: never replaced
    (a rename onto ``/dev/null`` would replace the device node itself)."""


#: The longest file name (bytes) most file systems take.
NAME_MAX = 255


def _check_target(target: Path) -> None:
    """``target`` is absent or a regular file (a link is followed to see what it names).

    Raises:
        NotARegularFile: it is something else.
    """
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        code = errno.EISDIR if stat.S_ISDIR(mode) else errno.EEXIST
        raise NotARegularFile(code, f"{target} is not a regular file; it is never replaced")


def temp_name(name: str, middle: str) -> str:
    """``.<name>.<middle>.tmp``, kept within :data:`NAME_MAX` bytes: a long ``name`` is cut
    and a hash of the whole name put after the cut (still ending ``.<middle>.tmp``)."""
    full = f".{name}.{middle}.tmp"
    if len(os.fsencode(full)) <= NAME_MAX:
        return full
    digest = hashlib.sha1(os.fsencode(name)).hexdigest()[:12]
    room = NAME_MAX - len(os.fsencode(f"..{digest}.{middle}.tmp"))
    stem = os.fsencode(name)[:room].decode("utf-8", errors="ignore")
    return f".{stem}{digest}.{middle}.tmp"


def temp_file_beside(target: str | os.PathLike[str]) -> str:
    """Create an empty temporary file in ``target``'s folder, with the permissions a
    plain ``open()`` would give, and return its path; ``os.replace`` it onto
    ``target`` once written (for writers that take a path, like profiler exports).

    It is named ``.<name>.<pid>.tmp`` (``.<name>.<random>.<pid>.tmp`` when that is
    taken; :func:`temp_name` for a long name), so that what an interrupted writer left can
    be told by its process id.

    Raises:
        NotARegularFile: ``target`` is a folder, a device, a FIFO or a socket.
    """
    target = Path(target)
    _check_target(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    pid = os.getpid()
    for attempt in range(100):
        middle = f"{pid}" if attempt == 0 else f"{secrets.token_hex(4)}.{pid}"
        tmp = target.parent / temp_name(target.name, middle)
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return str(tmp)
    raise FileExistsError(f"no free temporary name beside {target}")


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], Any]) -> Path:
    """Call ``write(f)`` on a temporary file in ``path``'s folder, flush it to disk and
    ``os.replace`` it onto ``path``: a reader (or a crash) sees the old file or the new
    one, never half of it. When ``write`` raises (Ctrl-C included) the temporary file is
    removed and ``path`` is left as it was.

    Raises:
        NotARegularFile: ``path`` is a folder, a device, a FIFO or a socket.
    """
    target = Path(path)
    tmp = temp_file_beside(target)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        _check_target(target)  # made a FIFO or a device meanwhile: still not replaced
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(target.parent)
    return target


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_write`)."""
    return atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """``atomic_write_bytes`` for UTF-8 text."""
    return atomic_write_bytes(path, text.encode("utf-8"))
