"""Processes seen from /proc, for the tests that launch ``lab2-train`` and signal its ranks
(Linux only), and a deadline-bound wait."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path


def children(pid: int, count: int | None = None) -> list[int]:
    """The pids whose parent is ``pid``, sorted; with ``count``, [] until there are exactly
    that many (a launcher whose ranks have not all started yet)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    if count is not None and len(found) != count:
        return []
    return sorted(found)


def running(pid: int) -> bool:
    """Alive and not a zombie (a dead rank waits for PID 1 to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None,
             poll_s: float = 0.1):
    """``predicate()``'s first truthy value within ``timeout`` seconds; AssertionError naming
    ``what`` if it never comes, or if ``proc`` exits first (with its stderr)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"exited ({proc.returncode}) before {what}: "
                                 f"{proc.stderr.read()}")
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")
