"""Run a command's ``main`` in a fresh interpreter and see which slow libraries it imported.

``--help`` must not import torch: on a small machine without cached bytecode that alone
takes 10 s or more. Checking the modules loaded, rather than timing the command, gives the
same answer on a loaded CI machine as on an idle one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

#: Libraries that take seconds to import; a command's help and version need none of them.
SLOW_IMPORTS = ("torch", "triton", "numpy", "matplotlib")

_PROBE = """
import json, sys
from {module} import main
try:
    code = main({argv!r})
except SystemExit as exc:
    code = exc.code
sys.stdout.flush()
loaded = sorted({{name.split(".")[0] for name in sys.modules}} & set({slow!r}))
print("\\n" + json.dumps({{"code": code, "loaded": loaded}}))
"""


@dataclass
class CliRun:
    code: int | str | None
    """What ``main`` returned or exited with."""
    out: str
    """What it printed on stdout."""
    slow_imports: list[str]
    """The libraries of ``SLOW_IMPORTS`` it imported."""


def run_main(module: str, argv: list[str], timeout: float = 120.0) -> CliRun:
    """``module.main(argv)`` in a fresh interpreter."""
    probe = _PROBE.format(module=module, argv=argv, slow=SLOW_IMPORTS)
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=timeout)
    out, _, last = proc.stdout.rstrip("\n").rpartition("\n")
    try:
        result = json.loads(last)
    except json.JSONDecodeError:
        raise AssertionError(f"{module} {argv} crashed (exit {proc.returncode}):\n"
                             f"{proc.stdout}\n{proc.stderr}") from None
    return CliRun(result["code"], out, result["loaded"])


def folder_listing(root) -> list[tuple[str, int, int]]:
    """Every file and folder under ``root`` with its size and modification time: what a
    command left behind, to compare before and after."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.stat(os.path.join(dirpath, name))
            out.append((os.path.relpath(os.path.join(dirpath, name), root), st.st_size,
                        st.st_mtime_ns))
    return sorted(out)


def entries(root) -> list[tuple[str, int, int, int]]:
    """Like :func:`folder_listing`, without following links (a link loop or a FIFO is
    listed, never opened): name, type bits, size and modification time."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            out.append((os.path.relpath(os.path.join(dirpath, name), root),
                        st.st_mode & 0o170000, st.st_size, st.st_mtime_ns))
    return sorted(out)


_MAINS = """
import contextlib, io, json, os, sys
from {module} import main
results = []
for cwd, argv in json.loads(sys.argv[1]):
    os.chdir(cwd)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    results.append({{"code": code, "err": err.getvalue()}})
print(json.dumps(results))
"""


@dataclass
class MainRun:
    code: int | str | None
    """What ``main`` returned or exited with."""
    err: str
    """What it printed on stderr."""


def run_mains(module: str, cases: list[tuple[str, list[str]]],
              timeout: float = 300.0) -> list[MainRun]:
    """``module.main(argv)`` for each ``(cwd, argv)`` of ``cases``, one after the other in
    one fresh interpreter (one import of the libraries for many refusals); a case that
    hangs fails the whole call at ``timeout``."""
    proc = subprocess.run([sys.executable, "-c", _MAINS.format(module=module),
                           json.dumps([(str(c), a) for c, a in cases])],
                          capture_output=True, text=True, timeout=timeout)
    try:
        return [MainRun(r["code"], r["err"]) for r in json.loads(proc.stdout.splitlines()[-1])]
    except (json.JSONDecodeError, IndexError):
        raise AssertionError(f"{module} crashed (exit {proc.returncode}):\n{proc.stdout}\n"
                             f"{proc.stderr}") from None


def one_error_line(rc: int, err: str, fragments: tuple[str, ...]) -> str:
    """The refusal ``lab2-train`` promises for bad input: exit code 2 and one line on stderr,
    ``lab2-train: error: ...``, holding every fragment; returns that line."""
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("lab2-train: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def refused_here(capsys, monkeypatch, args: list[str], folder, *fragments: str) -> str:
    """``lab2-train``'s ``main(args)`` in this process, run in ``folder``: one error line
    holding every fragment (:func:`one_error_line`), and nothing written there."""
    from lab2_trainer.cli.main import main

    folder.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(folder)
    before = folder_listing(folder)
    rc = main(args)
    line = one_error_line(rc, capsys.readouterr().err, fragments)
    assert folder_listing(folder) == before, "something was written"
    return line
