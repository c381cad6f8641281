"""Files written so that a reader, or a crash, sees the old file or the new one, never half
of it (:func:`atomic_write` and its bytes and text forms), and only where nothing is or a
regular file is: a folder, a device, a FIFO or a socket is never replaced
(:class:`NotARegularFile`). The temporary file lies beside the target, named
``.<name>.<pid>.tmp`` within the file system's name limit (:func:`temp_name`,
:func:`temp_file_beside`), so that what an interrupted writer left names its process.

Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["NAME_MAX", "NotARegularFile", "atomic_write", "atomic_write_bytes",
           "atomic_write_text", "check_target", "temp_file_beside", "temp_name"]

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


def check_target(target: str | os.PathLike[str]) -> None:
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
    check_target(target)
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
        check_target(target)  # made a FIFO or a device meanwhile: still not replaced
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
