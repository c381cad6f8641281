"""lab2sys.processes: threads per rank, a pid's start time, the parent-death signal, owner
records (live, dead and reused pids, other hosts and kinds) and the sweep of stale folders."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from lab2sys.processes import (
    OWNER_NAME,
    owner_gone,
    process_start,
    set_parent_death_signal,
    sweep_stale_folders,
    threads_per_rank,
    write_owner,
)

pytestmark = pytest.mark.timeout(60)
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


# ------------------------------------------------------------------ processes
def test_threads_per_rank_shares_the_cores():
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert threads_per_rank(1) == cores
    assert threads_per_rank(2) == max(1, cores // 2)
    assert threads_per_rank(10**6) == 1
    assert threads_per_rank(0) == cores  # no ranks counts as one


@linux
def test_process_start_tells_a_live_pid_from_a_gone_one():
    mine = process_start(os.getpid())
    assert isinstance(mine, int) and mine > 0
    assert process_start(os.getpid()) == mine  # fixed for the life of the process
    assert process_start(_dead_pid()) is None
    assert process_start(-1) is None


def test_the_parent_death_signal_is_refused_off_linux(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert set_parent_death_signal() is False


@linux
def test_a_child_that_asked_for_the_signal_dies_with_its_parent():
    # The middle process starts a grandchild that asks for SIGTERM on its parent's death and
    # says so, then exits: the grandchild must go, though it would sleep for a minute.
    grandchild = textwrap.dedent("""
        import sys, time
        from lab2sys.processes import set_parent_death_signal
        print("asked" if set_parent_death_signal() else "refused", flush=True)
        time.sleep(60)
    """)
    middle = textwrap.dedent(f"""
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", {grandchild!r}], stdout=subprocess.PIPE,
                                 text=True)
        print(child.stdout.readline().strip(), child.pid, flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", middle], capture_output=True, text=True,
                         timeout=30, check=True).stdout.split()
    assert out[0] == "asked", out
    pid = int(out[1])
    deadline = time.monotonic() + 20
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _alive(pid)
    if alive:
        os.kill(pid, 9)
    assert not alive, "the grandchild outlived its parent"


# ------------------------------------------------------------------ owner records
def _record(**fields) -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "process_start": process_start(os.getpid()), **fields}


def test_write_owner_names_this_process(tmp_path):
    write_owner(tmp_path, kind="test launcher", run="r1")
    info = json.loads((tmp_path / OWNER_NAME).read_text())
    assert info == _record(kind="test launcher", run="r1")
    assert sorted(p.name for p in tmp_path.iterdir()) == [OWNER_NAME]  # written atomically
    assert owner_gone(info) is False and owner_gone(info, "test launcher") is False


@linux
def test_a_record_of_a_gone_or_reused_pid_is_gone():
    assert owner_gone(_record(pid=_dead_pid())) is True
    assert owner_gone(_record(pid=_dead_pid(), process_start=None)) is True
    # This process's pid, but a record made by a process that started at another time.
    assert owner_gone(_record(process_start=process_start(os.getpid()) - 1)) is True


@pytest.mark.parametrize("info, kind", [
    (None, None),
    ("owner", None),
    ([1, 2], None),
    ({}, None),
    ({"pid": "1", "host": socket.gethostname()}, None),
    ({"pid": -5, "host": socket.gethostname()}, None),
    ({"pid": 0, "host": socket.gethostname()}, None),
    ("other host", None),
    ("other kind", "mine"),
    ("no start time", None),
])
def test_anything_else_is_not_gone(info, kind):
    # When in doubt, nothing is removed.
    if info == "other host":
        info = _record(pid=_dead_pid(), host=socket.gethostname() + "-not")
    elif info == "other kind":
        info = _record(pid=_dead_pid(), kind="theirs")
    elif info == "no start time":  # alive, its start time unknown: cannot say it is reused
        info = _record(process_start=None)
    assert owner_gone(info, kind) is False


# ------------------------------------------------------------------ the sweep
@linux
def test_the_sweep_removes_only_folders_of_gone_owners(tmp_path):
    host = socket.gethostname()
    dead = _dead_pid()
    folders = {
        "run-dead": _record(pid=dead, kind="k"),
        "run-reused": _record(process_start=process_start(os.getpid()) - 1, kind="k"),
        "run-live": _record(kind="k"),
        "run-elsewhere": _record(pid=dead, host=host + "-not", kind="k"),
        "run-other-kind": _record(pid=dead, kind="other"),
        "run-no-owner": None,
        "run-bad-owner": "{not json",
        "other-dead": _record(pid=dead, kind="k"),
    }
    for name, record in folders.items():
        (tmp_path / name).mkdir()
        if isinstance(record, dict):
            (tmp_path / name / OWNER_NAME).write_text(json.dumps(record))
        elif record is not None:
            (tmp_path / name / OWNER_NAME).write_text(record)
    (tmp_path / "run-a-file").write_text(json.dumps(_record(pid=dead)))
    removed = sweep_stale_folders(("run-",), str(tmp_path), kind="k")
    assert sorted(removed) == [str(tmp_path / "run-dead"), str(tmp_path / "run-reused")]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(set(folders) - {"run-dead", "run-reused"} | {"run-a-file"})
    # Without a kind, the other kind's dead owner goes too; two prefixes sweep both.
    removed = sweep_stale_folders(["run-other", "other-"], tmp_path)
    assert sorted(removed) == [str(tmp_path / "other-dead"), str(tmp_path / "run-other-kind")]


def test_the_sweep_of_a_missing_root_removes_nothing(tmp_path):
    assert sweep_stale_folders(("run-",), str(tmp_path / "absent")) == []


@pytest.mark.parametrize("prefixes, error", [("run-", TypeError), (b"run-", TypeError),
                                             (("run-", ""), ValueError), ([None], ValueError)])
def test_the_sweep_refuses_prefixes_that_would_match_too_much(tmp_path, prefixes, error):
    with pytest.raises(error, match="prefix"):
        sweep_stale_folders(prefixes, str(tmp_path))
