"""Files written atomically: a reader, or a crash, sees the old file or the new one.

Checkpoints, metrics, settings, plots and token caches are written to a temporary file in
the target's folder, flushed to disk and renamed onto the target. The temporary file is
named ``.<name>.<pid>.tmp`` (``.<name>.<random>.<pid>.tmp`` when that name is taken), so
that what an interrupted write left can be told by the pid of its writer
(:mod:`lab2_trainer.run_claim` removes such files).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO


def _sync_folder(folder: Path) -> None:
    """Flush a folder's entries (the rename) to disk, where the platform allows it."""
    flag = getattr(os, "O_DIRECTORY", None)
    if flag is None:
        return
    try:
        fd = os.open(folder, os.O_RDONLY | flag)
    except OSError:
        return
    with contextlib.suppress(OSError):
        os.fsync(fd)
    os.close(fd)


def temp_file_beside(target: str | os.PathLike[str]) -> str:
    """Create an empty temporary file in ``target``'s folder (with the permissions a plain
    ``open()`` gives) and return its path, for writers that take a path; rename it onto
    ``target`` with ``os.replace`` once written."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    pid = os.getpid()
    for attempt in range(100):
        middle = str(pid) if attempt == 0 else f"{secrets.token_hex(4)}.{pid}"
        tmp = target.parent / f".{target.name}.{middle}.tmp"
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return str(tmp)
    raise FileExistsError(f"no free temporary name beside {target}")


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], Any]) -> Path:
    """Call ``write(f)`` on a temporary file beside ``path``, then put it in ``path``'s
    place. When ``write`` raises (Ctrl-C included) the temporary file is removed and
    ``path`` is untouched."""
    target = Path(path)
    tmp = temp_file_beside(target)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _sync_folder(target.parent)
    return target


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """:func:`atomic_write` of UTF-8 text."""
    return atomic_write(path, lambda f: f.write(text.encode("utf-8")))
