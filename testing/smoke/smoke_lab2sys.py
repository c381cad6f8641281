"""Smoke test of an installed lab2sys: an atomic write and its refusal of a FIFO, an owner
record and the sweep that leaves a live owner's folder, all without torch."""

import json
import os
import sys
import tempfile
from pathlib import Path

import lab2sys
from lab2sys.files import NotARegularFile, atomic_write_text
from lab2sys.processes import OWNER_NAME, sweep_stale_folders, threads_per_rank, write_owner

with tempfile.TemporaryDirectory() as tmp:
    target = atomic_write_text(Path(tmp, "a.txt"), "one")
    atomic_write_text(target, "two")
    assert target.read_text() == "two" and os.listdir(tmp) == ["a.txt"], os.listdir(tmp)
    os.mkfifo(Path(tmp, "fifo"))
    try:
        atomic_write_text(Path(tmp, "fifo"), "x")
        raise AssertionError("a FIFO was replaced")
    except NotARegularFile:
        pass
    folder = Path(tmp, "smoke-live")
    folder.mkdir()
    write_owner(folder, kind="smoke")
    assert json.loads((folder / OWNER_NAME).read_text())["pid"] == os.getpid()
    assert sweep_stale_folders(("smoke-",), tmp, kind="smoke") == [] and folder.is_dir()
assert threads_per_rank(1) >= 1
assert "torch" not in sys.modules, "lab2sys imported torch"
print(f"lab2sys {lab2sys.__version__}: atomic writes, owner records and the sweep ok")
