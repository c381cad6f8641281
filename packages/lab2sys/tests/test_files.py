"""lab2sys.files: the atomic replace, what a failed write leaves, the refusal of anything
but a regular file (a FIFO included, without blocking), and temporary names that fit."""

from __future__ import annotations

import errno
import os
import socket
import stat
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lab2sys.files import (
    NAME_MAX,
    NotARegularFile,
    atomic_write,
    atomic_write_bytes,
    atomic_write_text,
    check_target,
    temp_file_beside,
    temp_name,
)

pytestmark = pytest.mark.timeout(60)  # a FIFO opened by mistake would block forever


def _names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ------------------------------------------------------------------ the atomic replace
def test_atomic_write_replaces_the_file_and_leaves_nothing_beside_it(tmp_path):
    p = atomic_write_text(tmp_path / "a.txt", "one")
    assert p == tmp_path / "a.txt" and p.read_text() == "one"
    atomic_write_text(p, "two")
    assert p.read_text() == "two"
    assert _names(tmp_path) == ["a.txt"]


def test_a_reader_of_the_old_file_keeps_reading_the_old_file(tmp_path):
    # A replace, not a rewrite in place: the old file lives on under the reader's handle.
    p = atomic_write_text(tmp_path / "a.txt", "old contents")
    before = os.stat(p).st_ino
    with open(p) as reader:
        atomic_write_text(p, "new")
        assert reader.read() == "old contents"
    assert p.read_text() == "new" and os.stat(p).st_ino != before


def test_bytes_text_and_writer_forms(tmp_path):
    assert atomic_write_bytes(tmp_path / "b.bin", b"\x00\xff").read_bytes() == b"\x00\xff"
    assert atomic_write_text(tmp_path / "t.txt", "é ✓").read_bytes() == "é ✓".encode()
    p = atomic_write(tmp_path / "w.bin", lambda f: (f.write(b"ab"), f.write(b"cd")))
    assert p.read_bytes() == b"abcd"


def test_missing_parent_folders_are_made(tmp_path):
    p = atomic_write_text(tmp_path / "x" / "y" / "z.txt", "deep")
    assert p.read_text() == "deep"


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_failed_write_leaves_the_old_file_and_no_temporary_file(tmp_path, error):
    p = atomic_write_text(tmp_path / "a.txt", "kept")

    def write(f):
        f.write(b"half of it")
        raise error("stopped")

    with pytest.raises(error, match="stopped"):
        atomic_write(p, write)
    assert p.read_text() == "kept"
    assert _names(tmp_path) == ["a.txt"]


def test_the_file_gets_the_permissions_a_plain_open_gives(tmp_path):
    plain = tmp_path / "plain"
    plain.write_text("x")
    p = atomic_write_text(tmp_path / "atomic", "x")
    assert stat.S_IMODE(os.stat(p).st_mode) == stat.S_IMODE(os.stat(plain).st_mode)


# ------------------------------------------------------------------ non-regular targets
def _fifo(path):
    os.mkfifo(path)
    return path


def _socket(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(str(path))
    except OSError as e:  # a path too long for AF_UNIX: nothing to test with
        pytest.skip(f"cannot bind a socket at {path}: {e}")
    finally:
        s.close()
    return path


def _folder(path):
    path.mkdir()
    (path / "inside.txt").write_text("kept")
    return path


KINDS = {"fifo": (_fifo, stat.S_ISFIFO), "socket": (_socket, stat.S_ISSOCK),
         "folder": (_folder, stat.S_ISDIR)}


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("how", ["text", "writer", "temp_file_beside", "check_target"])
def test_anything_but_a_regular_file_is_refused_and_left_as_it_was(tmp_path, kind, how):
    make, is_kind = KINDS[kind]
    target = make(tmp_path / "t")
    wrote = []
    calls = {"text": lambda: atomic_write_text(target, "x"),
             "writer": lambda: atomic_write(target, wrote.append),
             "temp_file_beside": lambda: temp_file_beside(target),
             "check_target": lambda: check_target(target)}
    with pytest.raises(NotARegularFile, match="not a regular file") as info:
        calls[how]()
    assert isinstance(info.value, OSError)
    assert info.value.errno == (errno.EISDIR if kind == "folder" else errno.EEXIST)
    assert is_kind(os.lstat(target).st_mode)
    assert wrote == [] and _names(tmp_path) == ["t"]  # refused before anything was written


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_link_to_a_fifo_is_refused(tmp_path):
    fifo = _fifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(fifo)
    with pytest.raises(NotARegularFile):
        atomic_write_text(tmp_path / "link", "x")
    assert (tmp_path / "link").is_symlink() and stat.S_ISFIFO(os.stat(fifo).st_mode)


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="no /dev/null here")
def test_a_device_is_never_replaced():
    with pytest.raises(NotARegularFile, match="/dev/null"):
        atomic_write_text("/dev/null", "x")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_made_while_writing_is_not_replaced(tmp_path):
    # Checked again just before the replace: a FIFO put in the target's place meanwhile
    # stays, and the temporary file goes.
    target = tmp_path / "t"
    target.write_text("first")

    def write(f):
        target.unlink()
        os.mkfifo(target)
        f.write(b"second")

    with pytest.raises(NotARegularFile):
        atomic_write(target, write)
    assert stat.S_ISFIFO(os.lstat(target).st_mode) and _names(tmp_path) == ["t"]


def test_absent_and_regular_targets_pass_the_check(tmp_path):
    check_target(tmp_path / "absent")
    (tmp_path / "file").write_text("x")
    check_target(tmp_path / "file")
    check_target(str(tmp_path / "file"))


# ------------------------------------------------------------------ temporary names
def test_a_short_name_keeps_its_plain_temporary_name():
    assert temp_name("a.txt", "123") == ".a.txt.123.tmp"


@pytest.mark.parametrize("name", ["a" * 255, "é" * 127 + "a", "✓" * 85, "a" * 200 + "é" * 27 + "a"])
@pytest.mark.parametrize("middle", ["4194303", "0123abcd.4194303"])
def test_the_temporary_name_of_a_255_byte_name_fits(name, middle):
    assert len(os.fsencode(name)) == 255
    tmp = temp_name(name, middle)
    assert len(os.fsencode(tmp)) <= NAME_MAX
    assert tmp.startswith(".") and tmp.endswith(f".{middle}.tmp")
    assert os.fsencode(tmp).decode("utf-8")  # cut at a character boundary


def test_long_names_that_share_their_start_get_different_temporary_names():
    a, b = "x" * 250 + "a.bin", "x" * 250 + "b.bin"
    assert temp_name(a, "1") != temp_name(b, "1")


@given(name=st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="/\x00"),
                    min_size=1, max_size=255).filter(lambda n: len(n.encode()) <= NAME_MAX),
       pid=st.integers(1, 2**22))
def test_temporary_names_always_fit(name, pid):
    tmp = temp_name(name, str(pid))
    assert len(os.fsencode(tmp)) <= NAME_MAX and tmp.endswith(f".{pid}.tmp")


def test_a_file_with_a_255_byte_name_is_written(tmp_path):
    target = tmp_path / ("n" * 251 + ".txt")
    atomic_write_text(target, "one")
    atomic_write_text(target, "two")
    assert target.read_text() == "two" and _names(tmp_path) == [target.name]


def test_temp_file_beside_names_the_writer_and_never_reuses_a_name(tmp_path):
    target = tmp_path / "out.json"
    first = temp_file_beside(target)
    second = temp_file_beside(target)
    pid = os.getpid()
    assert os.path.basename(first) == f".out.json.{pid}.tmp"
    assert first != second and os.path.basename(second).endswith(f".{pid}.tmp")
    assert os.path.getsize(first) == 0 and os.path.dirname(second) == str(tmp_path)
    assert not target.exists()


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX permissions")
def test_temp_file_beside_refuses_where_it_cannot_write(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        with pytest.raises(PermissionError):
            atomic_write_text(locked / "a.txt", "x")
    finally:
        locked.chmod(0o700)
