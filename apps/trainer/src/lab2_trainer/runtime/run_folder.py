"""The run folder: one run per output folder, and files written there atomically.

**One run per output folder**: an atomic claim, taken before anything is written there.
The claim is a lock file, ``<out>/.lab2-train.lock``, holding the owner's pid, host and
start time as JSON. It appears atomically, fully written and already locked: the content
goes to a private temporary file first, which is ``flock``-ed and then hard-linked to the
lock's name (``link`` fails if the name exists: the same guarantee as ``O_CREAT |
O_EXCL``, which is used where hard links are not supported). The owner keeps the file
open and locked for the whole run; forked ranks inherit the lock, so a folder stays
claimed until its last process is gone. At the end the owner removes the file.

A second run finds the file and tries the lock:

* held: the folder is in use, and the run is refused with the owner's pid and host;
* free: the owner died without cleaning up (``kill -9``, a crash, a reboot). The claim is
  stale unless its pid is still alive on this host with the same start time (a live
  owner that could not lock); a claim from another host is never taken over, since its
  process cannot be checked from here. A stale claim is taken over in place: holding the
  lock on that very file, the new owner rewrites it, so two runs racing for one stale
  claim cannot both win.

**Atomic writes**: a reader, or a crash, sees the old file or the new one. Checkpoints,
metrics, settings, plots and token caches are written to a temporary file in the target's
folder, flushed to disk and renamed onto the target (``atomic_write``, from
:mod:`lab2sys.files`, which lab2bench uses too). The temporary file is named ``.<name>.<pid>.tmp``
(``.<name>.<random>.<pid>.tmp`` when that name is taken), so that what an interrupted write
left can be told by the pid of its writer (:func:`clean_stale_temporaries` removes such
files); it fits wherever the target's name fits, and only an absent target or a regular file
is replaced (a folder, a device, a FIFO or a socket never is).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import socket
import stat
import time
from pathlib import Path
from typing import Any

from lab2_trainer.config import UsageError

# Atomic writes and process start times: one copy, shared with lab2bench (standard library
# only); the trainer's modules take the writers from here.
from lab2sys.files import NotARegularFile as NotARegularFile
from lab2sys.files import atomic_write as atomic_write
from lab2sys.files import atomic_write_text as atomic_write_text
from lab2sys.files import temp_name as temp_name
from lab2sys.processes import process_start

try:
    import fcntl
except ImportError:  # not POSIX: pid and host alone decide
    fcntl = None  # type: ignore[assignment]


# --------------------------------------------------------------------------- run claim
LOCK_NAME = ".lab2-train.lock"
# A lock "file" that is a symlink is never followed: a takeover must not truncate whatever
# it points to.
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
# Temporary files of interrupted atomic writes: .<name>[.<random>].<pid>.tmp (see
# the atomic writes below), and .<stem>.<pid>.tmp.png of earlier versions.
TEMPORARY = re.compile(r"^\..+\.(\d+)\.tmp(\.png)?$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def _owner_alive(info: dict[str, Any]) -> bool:
    """Whether a claim's owner (on this host) still runs."""
    pid = info.get("pid")
    if not isinstance(pid, int) or pid <= 0 or not _pid_alive(pid):
        return False
    started, now = info.get("process_start"), process_start(pid)
    return started is None or now is None or started == now


def _describe(info: dict[str, Any] | None) -> str:
    if not info:
        return "another run (its claim is being written)"
    return (f"another run (pid {info.get('pid')} on host {info.get('host')}, since "
            f"{info.get('since', '?')})")


def _try_lock(fd: int) -> bool | None:
    """Lock ``fd`` without waiting: True locked, False held elsewhere, None unsupported."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return None


def _read(fd: int) -> dict[str, Any] | None:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = os.read(fd, 65536)
        info = json.loads(data.decode())
        return info if isinstance(info, dict) else None
    except (OSError, ValueError):
        return None


class RunClaim:
    """A claimed output folder; :meth:`release` gives it back (also as a context manager).

    Use :func:`claim_folder` to get one.

    Attributes:
        took_over: None for a fresh claim; for a stale one taken over, what the old claim
            said (``{}`` when its file was empty or unreadable), for the note on stderr.
    """

    def __init__(self, folder: Path, fd: int, took_over: dict[str, Any] | None,
                 created_folder: bool) -> None:
        self.folder = folder
        self.path = folder / LOCK_NAME
        self.fd: int | None = fd
        self.took_over = took_over
        self.created_folder = created_folder

    def release(self) -> None:
        """Remove the lock file (if it is still ours) and close it."""
        if self.fd is None:
            return
        try:
            with contextlib.suppress(OSError):
                if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                    os.unlink(self.path)
        finally:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> RunClaim:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _content() -> bytes:
    info = {"pid": os.getpid(), "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "process_start": process_start(os.getpid())}
    return (json.dumps(info) + "\n").encode()


def _publish(lock: Path) -> int | None:
    """Create the lock file, complete and locked; its fd, or None when it exists."""
    tmp = lock.with_name(f"{LOCK_NAME}.new-{os.getpid()}-{time.monotonic_ns()}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _try_lock(fd)
        os.write(fd, _content())
        os.fsync(fd)
        try:
            os.link(tmp, lock)
        except FileExistsError:
            os.close(fd)
            return None
        except OSError:  # no hard links here: O_EXCL on the name itself
            os.close(fd)
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
            except FileExistsError:
                return None
            _try_lock(fd)
            os.write(fd, _content())
            os.fsync(fd)
        return fd
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _take_over_or_refuse(lock: Path, folder: Path) -> tuple[int, dict[str, Any]] | None:
    """Inspect an existing claim: take it over when stale (returns the fd and the old
    claim), None when the file vanished meanwhile (try again); raises when it is live."""
    try:
        fd = os.open(lock, os.O_RDWR | _NOFOLLOW)
    except FileNotFoundError:
        return None
    keep = False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UsageError(f"--out {folder}: {lock} is not a regular file; remove it "
                             "(nothing was written)")
        locked = _try_lock(fd)
        info = _read(fd)
        if locked is False:
            raise UsageError(in_use_message(folder, info))
        try:
            if os.stat(lock).st_ino != os.fstat(fd).st_ino:
                return None  # released and replaced while we looked: start over
        except FileNotFoundError:
            return None
        host = socket.gethostname()
        if info and info.get("host") not in (None, host):
            raise UsageError(
                f"--out {folder} is claimed by {_describe(info)}, which cannot be checked "
                f"from {host}: if that run is over, remove {lock} (nothing was written)")
        if info and _owner_alive(info):
            raise UsageError(in_use_message(folder, info))
        if info is None and time.time() - os.fstat(fd).st_mtime < 10:
            raise UsageError(f"--out {folder} is being claimed by another run right now "
                             "(nothing was written)")
        # Stale: ours now. Rewrite it in place, holding the lock on this very file.
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, _content())
        os.fsync(fd)
        keep = True
        return fd, (info or {})
    finally:
        if not keep:
            os.close(fd)


def claim_folder(folder: str | os.PathLike) -> RunClaim:
    """Claim ``folder`` (created if missing) for this process.

    Raises:
        UsageError: another live run holds it, its claim cannot be checked from this
            host, or the folder cannot be created or written.
    """
    folder = Path(folder)
    created = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create --out {folder}: {exc.strerror or exc}") from None
    lock = folder / LOCK_NAME
    try:
        for _ in range(20):
            fd = _publish(lock)
            if fd is not None:
                return RunClaim(folder, fd, None, created)
            taken = _take_over_or_refuse(lock, folder)
            if taken is not None:
                return RunClaim(folder, taken[0], taken[1], created)
        raise UsageError(f"--out {folder}: could not claim it (other runs keep claiming and "
                         "releasing it)")
    except OSError as exc:
        _remove_if_created(folder, created)
        raise UsageError(f"cannot claim --out {folder}: {exc.strerror or exc}") from None
    except UsageError:
        _remove_if_created(folder, created)
        raise


def _remove_if_created(folder: Path, created: bool) -> None:
    if created:
        with contextlib.suppress(OSError):
            folder.rmdir()


def clean_stale_temporaries(folder: str | os.PathLike, *, only_dead_writers: bool) -> list[str]:
    """Remove what interrupted atomic writes left in ``folder`` (``.ckpt.pt.<pid>.tmp``
    and the like); returns the names removed.

    Args:
        only_dead_writers: keep files whose writer (the pid in the name) still runs on
            this host: for a folder this process has not claimed.
    """
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        match = TEMPORARY.match(entry.name)
        if not match or not entry.is_file(follow_symlinks=False):
            continue
        if only_dead_writers and _pid_alive(int(match.group(1))):
            continue
        with contextlib.suppress(OSError):
            os.unlink(entry.path)
            removed.append(entry.name)
    return removed


def live_claim(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The claim of the live run holding ``folder`` (its lock file is locked, or names a
    live process on this host, or one on another host), or None when none does."""
    lock = Path(folder) / LOCK_NAME
    try:
        fd = os.open(lock, os.O_RDONLY | _NOFOLLOW)
    except OSError:
        return None
    try:
        locked = _try_lock(fd)
        info = _read(fd) or {}
        if locked is False:
            return info
        if info.get("host") not in (None, socket.gethostname()):
            return info
        return info if info and _owner_alive(info) else None
    finally:
        os.close(fd)


def folder_is_claimed(folder: str | os.PathLike) -> bool:
    """Whether a live run holds ``folder`` (see :func:`live_claim`)."""
    return live_claim(folder) is not None


def in_use_message(folder: str | os.PathLike, info: dict[str, Any] | None) -> str:
    """The one line that refuses a run whose ``--out`` another run holds."""
    return (f"--out {folder} is in use by {_describe(info)}: wait for it to finish or choose "
            "another --out (nothing was written)")


#: Errors of a write that the machine refused: a full disk or quota, a file over the size
#: limit, a read-only file system, an I/O error.
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO)


#: What torch's zip writer (``torch.save``) says when the file under it refused a write.
SHORT_WRITE = "unexpected pos"


class WriteFailed(RuntimeError):
    """A write the run needed failed on every rank at once (a sharded checkpoint's save,
    a collective): its message is the one line to print, by rank 0."""


def refused_write(exc: BaseException) -> OSError | None:
    """The write the machine refused behind ``exc`` (:data:`WRITE_ERRNOS`), found anywhere
    in its chain (torch.save wraps the OSError in a RuntimeError) or among the per-rank
    failures of a ``torch.distributed.checkpoint`` exception; None when there is none."""
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in WRITE_ERRNOS:
            return e
        if isinstance(e, RuntimeError) and SHORT_WRITE in str(e):
            # torch's zip writer after a refused write, its OSError lost (a checkpoint's
            # per-rank failures reach every rank pickled, without their chains)
            return OSError(errno.EIO, "the file system refused a write (a full disk, a quota "
                           "or a file-size limit)")
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):  # rank: (exception, traceback)
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return None


def write_failure(exc: BaseException) -> str | None:
    """The one line that says ``exc`` is a write the machine refused, or None when it is
    not (see :func:`refused_write`)."""
    refused = refused_write(exc)
    if refused is None:
        return None
    where = f" ({refused.filename})" if refused.filename else ""
    return (f"a write failed: {refused.strerror or os.strerror(refused.errno)}{where}; files "
            "are written atomically, so what was there before is intact")
