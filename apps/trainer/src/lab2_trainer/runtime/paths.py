"""Checks of the paths a run reads and writes, made before any rank starts, so that a bad
path costs one line on stderr, exit code 2, and no file written:

* :func:`check_out_path`: ``--out`` is a folder, or can become one, and the files a run
  writes there are absent or regular files;
* :func:`check_input_path`, :func:`read_bounded_text`: an input (``--data``,
  ``--resume``, ``--config``) is a regular file or a folder, never a FIFO or a device,
  which could block a read or never end (checked with ``stat``, before any read), and a
  config file is read with a size bound;
* :func:`check_output_file`: an output file (``plan --plot``, ``export``) is absent or a
  regular file, in a folder; :func:`check_path_length`: a path the system could not open is
  one line, not a traceback.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import IO, Any

from lab2_trainer.config import UsageError
from lab2sys.files import NotARegularFile

#: The longest file name and path Linux takes (NAME_MAX, PATH_MAX): a longer one fails
#: with ENAMETOOLONG wherever it is used.
NAME_MAX, PATH_MAX = 255, 4096
#: The largest ``--config`` file read (a settings file is a few hundred bytes).
CONFIG_MAX_BYTES = 1024 * 1024


def shown(path: Any, limit: int = 80) -> str:
    """``path`` as a message quotes it: whole when short, else its start and its length
    (a 10 MB path must not make a 10 MB error line)."""
    text = str(path)
    if len(text) <= limit and text.isprintable():
        return text
    return f"{text[: limit // 2]!r}... ({len(text):,} characters)"


def file_kind(mode: int) -> str | None:
    """What a non-regular file is, in words (None: a regular file)."""
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, None)):
        if test(mode):
            return name
    return "not a regular file"


def check_path_length(path: Any, what: str) -> None:
    """``path`` is one the system can open: no NUL, no name over :data:`NAME_MAX` bytes,
    not over :data:`PATH_MAX` bytes in all.

    Raises:
        UsageError: naming ``what`` (the flag) and the part that is too long.
    """
    text = str(path)
    if "\0" in text:
        raise UsageError(f"{what} {shown(path)}: a path cannot hold a NUL character")
    size = len(os.fsencode(text))
    if size >= PATH_MAX:
        raise UsageError(f"{what} {shown(path)}: the path is {size:,} bytes, more than the "
                         f"{PATH_MAX - 1:,} a path may have")
    for part in Path(text).parts:
        if len(os.fsencode(part)) > NAME_MAX:
            name = "the name" if part == text else f"the name {shown(part, 40)}"
            raise UsageError(f"{what} {shown(path)}: {name} is {len(os.fsencode(part)):,} "
                             f"bytes, more than the {NAME_MAX} a file name may have")


def _stat(path: Path, what: str) -> os.stat_result | None:
    """``stat`` of ``path`` (following links); None when it does not exist.

    Raises:
        UsageError: a symbolic link loop, a path that is too long, or another error.
    """
    check_path_length(path, what)
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UsageError(f"{what} {shown(path)}: a loop of symbolic links (it never "
                             "reaches a file)") from None
        if exc.errno == errno.ENOTDIR:
            return None
        raise UsageError(f"{what} {shown(path)}: cannot be examined "
                         f"({exc.strerror or exc})") from None


def check_input_path(path: str | os.PathLike, what: str, *, folder: bool = True,
                     missing: str = "does not exist") -> Path:
    """An input ``path`` exists and is a regular file, or a folder where ``folder``
    allows: checked with ``stat``, before any read (a FIFO would block it, a device like
    ``/dev/zero`` never end it).

    Args:
        what: the flag, for the message.
        folder: whether a folder is a valid input.
        missing: what to say of a path that does not exist.

    Raises:
        UsageError: one line naming the flag and what the path is.
    """
    p = Path(path).expanduser()
    st = _stat(p, what)
    if st is None:
        if os.path.islink(p):
            raise UsageError(f"{what} {shown(path)}: a symbolic link to "
                             f"{shown(os.readlink(p))}, which does not exist")
        raise UsageError(f"{what} {shown(path)}: {missing}")
    kind = file_kind(st.st_mode)
    if kind is None or (folder and stat.S_ISDIR(st.st_mode)):
        return p
    expected = "a regular file or a folder" if folder else "a regular file"
    raise UsageError(f"{what} {shown(path)} is {kind}, not {expected}: refused before "
                     "reading it (nothing was read)")


def read_bounded_text(path: str | os.PathLike, what: str,
                      limit: int = CONFIG_MAX_BYTES) -> str:
    """The UTF-8 text of a regular file of at most ``limit`` bytes (a file swapped for a
    FIFO after the check is opened without blocking, and refused).

    Raises:
        UsageError: not a regular file, too large, unreadable, or not UTF-8.
    """
    p = check_input_path(path, what, folder=False, missing="cannot read it: it does not exist")
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise UsageError(f"{what} {shown(path)}: cannot read it ({exc.strerror or exc})") \
            from None
    try:
        st = os.fstat(fd)
        kind = file_kind(st.st_mode)
        if kind is not None:
            raise UsageError(f"{what} {shown(path)} is {kind}, not a regular file (nothing was "
                             "read)")
        if st.st_size > limit:
            raise UsageError(f"{what} {shown(path)} is {st.st_size:,} bytes; a settings file "
                             f"is at most {limit:,}")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise UsageError(f"{what} {shown(path)}: cannot read it ({exc.strerror or exc})") \
            from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise UsageError(f"{what} {shown(path)} is over {limit:,} bytes; a settings file is "
                         f"at most {limit:,}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{what} {shown(path)}: not UTF-8 text ({exc})") from None


def check_output_file(path: str | os.PathLike, what: str, *,
                      make_parents: bool = False) -> Path:
    """An output file's ``path`` is absent or a regular file, in an existing folder (with
    ``make_parents``, in a folder that can be made: its nearest existing ancestor is a
    writable folder): a folder, a device, a FIFO or a socket there is never replaced.

    Raises:
        UsageError: one line naming the flag and what is in the way.
    """
    p = Path(path).expanduser()
    if str(path) == "":
        raise UsageError(f"{what} is empty: name a file")
    st = _stat(p, what)
    if st is not None and file_kind(st.st_mode) is not None:
        raise UsageError(f"{what} {shown(path)} is {file_kind(st.st_mode)}: only a new or a "
                         "regular file is written (nothing was written)")
    parent = p.parent
    pst = _stat(parent, what)
    while make_parents and pst is None and parent.parent != parent:
        parent = parent.parent  # made by the write; what is above must be a folder
        pst = _stat(parent, what)
    if pst is None or not stat.S_ISDIR(pst.st_mode):
        raise UsageError(f"{what} {shown(path)}: {shown(parent)} is not a folder (nothing was "
                         "written)")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{what} {shown(path)}: {shown(parent)} is not writable (nothing was "
                         "written)")
    return p


#: The files a run writes in its ``--out`` folder, and the folder of its checkpoints.
RUN_FILES = ("settings.toml", "metrics.jsonl", "summary.json", "sample.txt",
             "loss_curve.png", "ckpt.pt")
RUN_FOLDERS = ("ckpt",)


def check_out_path(out: str) -> None:
    """``out`` is an existing folder, or a path where a folder can be made; the files a run
    writes there (:data:`RUN_FILES`) are absent or regular files, and its checkpoint folder
    (:data:`RUN_FOLDERS`) absent or a folder.

    Raises:
        UsageError: it is empty, too long, a file, a parent is a file, it cannot be
            written, or a run file there is a FIFO, a device, a folder or a socket.
    """
    if out == "":
        raise UsageError("--out is empty: name a folder (or leave --out out for "
                         "runs/<preset>-<time>)")
    p = Path(out).expanduser()
    st = _stat(p, "--out")
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"--out {shown(out)} exists and is not a folder (nothing was "
                         "written)")
    if st is not None:
        for name in RUN_FILES + RUN_FOLDERS:
            found = _stat(p / name, "--out")
            kind = found is not None and file_kind(found.st_mode)
            if name in RUN_FOLDERS and found is not None and not stat.S_ISDIR(found.st_mode):
                raise UsageError(f"--out {shown(out)}: {name} there is "
                                 f"{kind or 'a regular file'}, not the folder a run keeps its "
                                 "checkpoints in (nothing was written)")
            if kind and name in RUN_FILES:
                raise UsageError(f"--out {shown(out)}: {name} there is {kind}; a run writes "
                                 "only new or regular files (nothing was written)")
    probe = p
    while not probe.exists():
        parent = probe.parent
        if parent == probe:
            break
        probe = parent
    if probe.exists() and not probe.is_dir():
        raise UsageError(f"--out {shown(out)}: {shown(probe)} is a file, not a folder (nothing "
                         "was written)")
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"--out {shown(out)}: {shown(probe)} is not writable (nothing was "
                         "written)")


def open_regular(path: str | os.PathLike) -> IO[bytes]:
    """``path`` opened for reading without blocking (a FIFO's open would wait for a writer
    forever), and only when it is a regular file.

    Raises:
        NotARegularFile: it is a FIFO, a device, a socket or a folder.
        OSError: it cannot be opened.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotARegularFile(errno.EINVAL, f"{path} is not a regular file; never read")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
