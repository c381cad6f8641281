"""Hostile input, third pass: paths that are not plain files, and messages that said the
wrong thing (issue 39, findings 1 to 6 and 15). The real command in a subprocess, in an
empty folder, with real FIFOs, device nodes made in that folder, sockets and link loops:
exit code, the number of stderr lines, and what is left on disk. Variants of a finding run
one after the other in one subprocess (:func:`lab2_testing.cli.run_mains`, one torch
import for all of them).

1. an output path (``plan --plot``, a run's files in ``--out``) that is a device, a FIFO,
   a socket or a folder is refused, and left as it was; 2. a read-only or unwritable place
   is one line; 3. a 250-byte file name is written (its temporary name fits too); 4.
   over-long paths are one line; 5. FIFOs never block; 6. endless devices are never read;
   15. a link loop, a FIFO as ``--resume``, ``--out ''``, ``plan --json``'s strict JSON,
   and a run stopped before its first checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab2_testing.cli import entries, run_mains
from lab2sys.files import NAME_MAX, atomic_write_text, temp_name

pytestmark = pytest.mark.timeout(300)

#: The review's tiny run, on one rank.
B = ["--steps", "3", "--batch-size", "4", "--d-model", "32", "--n-layers", "1", "--n-heads",
     "2", "--d-ff", "64", "--context-length", "32", "--eval-batches", "1", "--eval-every", "0",
     "--sample-tokens", "0", "--no-plot", "--quiet", "--nproc", "1"]
CLI = [sys.executable, "-c", "import sys; from lab2_trainer.cli.main import main; sys.exit(main())"]
START_S = 180  # a fresh interpreter importing torch on a loaded 2-core machine


def lab2_train(args: list[str], cwd: Path, timeout: float = START_S):
    return subprocess.run([*CLI, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def one_line(code, err: str, *fragments: str, expect: int = 2) -> str:
    lines = err.strip().splitlines()
    assert code == expect, err
    assert len(lines) == 1 and lines[0].startswith("lab2-train"), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert len(lines[0]) < 400, "the line quotes a whole path"
    return lines[0]


def device_node(folder: Path, name: str = "node") -> Path:
    """A character device (1, 3: the null device) made in ``folder``; skips where making
    device nodes is not permitted."""
    path = folder / name
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except (PermissionError, OSError) as exc:
        pytest.skip(f"cannot make a device node here: {exc}")
    return path


def unix_socket(folder: Path, name: str = "sock") -> tuple[Path, socket.socket]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(folder / name))
    return folder / name, s


def _prepare(root: Path, corpus: Path) -> dict[str, tuple[Path, list[str]]]:
    """Every refusal of this file that needs the trainer (torch), each in its own folder."""
    cases: dict[str, tuple[Path, list[str]]] = {}

    def case(name: str, *argv: str) -> Path:
        folder = root / name
        folder.mkdir()
        cases[name] = (folder, [*B, *argv])
        return folder

    data = ("--data", str(corpus))
    long = "a" * 300
    # 1. a run's files in --out that are a FIFO or a device
    for name in ("summary.json", "metrics.jsonl", "sample.txt"):
        run = case(f"1-{name}", *data, "--out", "run") / "run"
        run.mkdir()
        if name == "metrics.jsonl":
            device_node(run, name)
        else:
            os.mkfifo(run / name)
    # 4. over-long paths
    case("4-out", *data, "--out", long)
    case("4-resume", *data, "--resume", long)
    case("4-data", "--data", long)
    (case("4-config-size", *data, "--config", "big.toml") / "big.toml").write_text(
        f'out = "{"x" * 10_000_000}"\n')
    (case("4-config-out", *data, "--config", "long.toml") / "long.toml").write_text(
        f'out = "{"x/" * 50_000}"\n')
    # 5. a FIFO among token arrays
    os.mkfifo(case("5-npy", "--data", "x.npy", "--vocab-size", "256") / "x.npy")
    # 6. endless devices, and a device node
    case("6-data-zero", "--data", "/dev/zero")
    case("6-config-zero", "--config", "/dev/zero")
    device_node(case("6-data-node", "--data", "node"))
    device_node(case("6-config-node", "--config", "node"))
    # 15. what the message says
    for name, argv in (("15-loop-data", ["--data", "loop-a"]),
                       ("15-loop-resume", [*data, "--resume", "loop-a"])):
        folder = case(name, *argv)
        os.symlink("loop-b", folder / "loop-a")
        os.symlink("loop-a", folder / "loop-b")
    os.mkfifo(case("15-fifo-resume", *data, "--resume", "fifo") / "fifo")
    os.symlink("nowhere", case("15-dangling", "--data", "dangling") / "dangling")
    case("15-empty-out", *data, "--out", "")
    case("15-empty-data", "--data", "")
    return cases


@pytest.fixture(scope="module")
def refused(corpus_dir, tmp_path_factory) -> dict[str, str]:
    """Every case of :func:`_prepare`, run in one interpreter, checked for exit 2, one line
    and nothing changed on disk: the line of each."""
    cases = _prepare(tmp_path_factory.mktemp("refused"), corpus_dir)
    before = {name: entries(folder) for name, (folder, _) in cases.items()}
    runs = run_mains("lab2_trainer.cli.main", list(cases.values()))
    lines = {}
    for (name, (folder, _)), run in zip(cases.items(), runs):
        assert entries(folder) == before[name], f"{name}: something changed on disk"
        lines[name] = one_line(run.code, run.err)
    return lines


def expect(line: str, *fragments: str) -> None:
    for fragment in fragments:
        assert fragment in line, line


# ------------------------------------------------------------------- 1. output paths
def test_1_plot_never_replaces_a_device_a_fifo_a_socket_or_a_folder(tmp_path):
    node = device_node(tmp_path)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "folder").mkdir()
    sock, held = unix_socket(tmp_path)
    before = entries(tmp_path)
    try:
        for name, kind in (("node", "character device"), ("fifo", "FIFO"),
                           ("sock", "socket"), ("folder", "folder")):
            proc = lab2_train(["plan", "--plot", name], tmp_path, timeout=60)
            one_line(proc.returncode, proc.stderr, f"--plot {name} is a", kind,
                     "nothing was written")
    finally:
        held.close()
    assert entries(tmp_path) == before
    assert stat.S_ISCHR(os.lstat(node).st_mode) and os.major(os.lstat(node).st_rdev) == 1
    assert stat.S_ISSOCK(os.lstat(sock).st_mode)


def test_1_a_run_never_replaces_a_fifo_or_a_device_in_its_folder(refused):
    for name in ("summary.json", "metrics.jsonl", "sample.txt"):
        expect(refused[f"1-{name}"], f"--out run: {name} there is a", "nothing was written")


# ------------------------------------------------------- 2. unwritable places, in one line
def test_2_plot_onto_an_unwritable_place_is_one_line(tmp_path):
    # /proc/sys is read-only in a container and for a user; /proc takes no new file, though
    # the check before writing cannot tell (the write itself fails: exit 1).
    if os.access("/proc/sys", os.W_OK):
        pytest.skip("/proc/sys is writable here")
    proc = lab2_train(["plan", "--plot", "/proc/sys/plan.png"], tmp_path, timeout=60)
    one_line(proc.returncode, proc.stderr, "--plot /proc/sys/plan.png", "not writable")
    proc = lab2_train(["plan", "--plot", "/proc/plan.png"], tmp_path, timeout=60)
    one_line(proc.returncode, proc.stderr, "cannot write it", expect=1)
    assert entries(tmp_path) == []


# ------------------------------------------------------------- 3. names near the limit
def test_3_a_250_byte_name_is_written_and_its_temporary_name_fits(tmp_path):
    name = "p" * 246 + ".png"
    proc = lab2_train(["plan", "--plot", name], tmp_path, timeout=60)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert [e[0] for e in entries(tmp_path)] == [name]
    assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for stem in ("a" * 255, "é" * 127, "x" * 200):
        for middle in ("4242", "deadbeef.4242"):
            tmp = temp_name(stem, middle)
            assert len(os.fsencode(tmp)) <= NAME_MAX and tmp.endswith(f".{middle}.tmp")
    atomic_write_text(tmp_path / ("é" * 127), "ok")  # 254 bytes, and UTF-8 cut safely
    assert (tmp_path / ("é" * 127)).read_text() == "ok"


# ------------------------------------------------------------------ 4. over-long paths
def test_4_over_long_paths_are_one_line(refused):
    expect(refused["4-out"], "--out 'aaaa", "300 bytes, more than the 255")
    expect(refused["4-resume"], "--resume 'aaaa", "300 bytes")
    expect(refused["4-data"], "--data 'aaaa", "300 bytes")
    expect(refused["4-config-size"], "--config big.toml is 10,000,009 bytes")
    expect(refused["4-config-out"], "--out 'x/x/", "100,000 characters",
           "more than the 4,095 a path may have")


# ---------------------------------------------------------------------- 5. FIFOs
def test_5_a_fifo_as_data_or_config_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "f")
    for flag in ("--data", "--config"):
        proc = lab2_train([*B, flag, "f"], tmp_path, timeout=120)
        one_line(proc.returncode, proc.stderr, f"{flag} f is a FIFO", "nothing was read")
    assert [e[0] for e in entries(tmp_path)] == ["f"]


def test_5_a_fifo_named_like_a_token_array_is_refused(refused):
    expect(refused["5-npy"], "--data x.npy is a FIFO")


# ------------------------------------------------------------------ 6. endless devices
def test_6_devices_are_never_read(refused):
    expect(refused["6-data-zero"], "--data /dev/zero is a character device")
    expect(refused["6-config-zero"], "--config /dev/zero is a character device")
    expect(refused["6-data-node"], "--data node is a character device")
    expect(refused["6-config-node"], "--config node is a character device")


# ------------------------------------------------------------ 15. the right message
def test_15_messages_name_what_is_wrong(refused):
    expect(refused["15-loop-data"], "--data loop-a: a loop of symbolic links")
    expect(refused["15-loop-resume"], "--resume loop-a: a loop of symbolic links")
    expect(refused["15-fifo-resume"], "--resume fifo is a FIFO")
    expect(refused["15-dangling"], "--data dangling: a symbolic link to nowhere, which does "
           "not exist")
    expect(refused["15-empty-out"], "--out is empty")
    expect(refused["15-empty-data"], "--data is empty")


def test_15_plan_json_is_strict(tmp_path):
    proc = lab2_train(["plan", "--json", "--gpus-per-node", "8", "--efficiency", "1e-320",
                       "--nvlink-gbs", "1e-320"], tmp_path, timeout=60)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr

    def refuse(constant):
        raise AssertionError(f"{constant} in plan --json")

    result = json.loads(proc.stdout, parse_constant=refuse)
    assert result["time"]["step_s"] is None and "time.step_s" in result["non_finite"]
    assert any("null stands for" in line for line in result["assumptions"])
    # A prediction too fast for a float: no ZeroDivisionError either.
    proc = lab2_train(["plan", "--json", "--peak-tflops", "1e308"], tmp_path, timeout=60)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert json.loads(proc.stdout, parse_constant=refuse)["time"]["tokens_per_s"] is None
    assert entries(tmp_path) == []


def test_15_a_run_stopped_before_its_first_checkpoint_says_so(corpus_dir, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([*CLI, *B, "--data", str(corpus_dir), "--steps", "100000",
                             "--log-every", "1", "--out", str(out)], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + START_S
        while not (out / "metrics.jsonl").exists() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    one_line(proc.returncode, err, "stopped by SIGTERM; no checkpoint was written yet",
             expect=143)
    assert not (out / "ckpt.pt").exists() and not list(out.glob("ckpt/step-*/manifest.json"))
    assert not (out / ".lab2-train.lock").exists()
