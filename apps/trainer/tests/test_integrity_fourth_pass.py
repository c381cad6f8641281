"""Run integrity, fourth pass (issue 49): what a hostile user did to a checkpoint and to
``export`` on the CPU with Gloo, one test per finding. Every case starts from a copy of one
base run (two ranks, checkpoints at steps 5 and 10, all kept); the command itself
(``main``) in this process, with a deadline where a FIFO could block it.

1. a shard the manifest does not list is refused; 2. ``export`` refuses non-finite values
as ``--resume`` does; 3. an unreadable manifest in the newest step is named and its folder
set aside, never overwritten; 4. a run killed in its first save leaves a folder a fresh run
starts in; 5. a step saved again starts from an empty folder; 6. a resume names the partial
step it passed over; 7. a FIFO named like a shard never blocks a save; 8. ``export``'s
output is checked as ``--out`` is, and never lands in a checkpoint; 9. a diverged run is
one line; 10. smaller messages, and ``--eps 0``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import threading
from pathlib import Path

import pytest

from lab2_testing.cli import entries
from lab2_trainer.checkpoint import single_file as integrity
from lab2_trainer.checkpoint.folders import MANIFEST, TRAINER_STATE, file_crc, verify
from lab2_trainer.checkpoint.parts import full_tensors
from lab2_trainer.cli.main import build_parser, given_settings, main, resolve_settings

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(sys.platform != "linux", reason="FIFOs, /proc")]

#: A small model and a short run: the findings are about files, not about the model.
SMALL = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--d-ff", "64",
         "--context-length", "32", "--batch-size", "8", "--eval-every", "0",
         "--eval-batches", "1", "--sample-tokens", "0", "--no-plot", "--quiet"]
START_S = 180  # a run's start and its few steps on a loaded 2-core machine, at most


@pytest.fixture(scope="module")
def base(corpus_dir, tmp_path_factory) -> Path:
    """The issue's base run: 2 ranks, 10 steps, checkpoints at 5 and 10, both kept."""
    out = tmp_path_factory.mktemp("base") / "run"
    assert main([*SMALL, "--data", str(corpus_dir), "--steps", "10", "--nproc", "2",
                 "--ckpt-every", "5", "--keep-last", "0", "--out", str(out)]) == 0
    return out


def copy_run(base: Path, tmp_path: Path, name: str = "run") -> Path:
    out = tmp_path / name
    shutil.copytree(base, out)
    return out


def step(run: Path, n: int) -> Path:
    return run / "ckpt" / f"step-{n:06d}"


def refused(capsys, argv: list[str], root: Path) -> str:
    """``main(argv)`` exits 2 with one line and changes nothing under ``root``."""
    before = entries(root)
    rc = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("lab2-train: error: "), err
    assert entries(root) == before, "something was written"
    return lines[0]


def notes(err: str) -> list[str]:
    return [line for line in err.strip().splitlines() if line.startswith("lab2-train: note:")]


def relist(folder: Path) -> None:
    """The manifest's checksums made to match the files it lists (bad content, good sums)."""
    manifest = json.loads((folder / MANIFEST).read_text())
    for name, entry in manifest["files"].items():
        size, crc = file_crc(folder / name)
        entry.update(bytes=size, crc32=f"{crc:08x}")
    (folder / MANIFEST).write_text(json.dumps(manifest))


# ------------------------------------------------------------ 1. every file a load reads
def test_1_a_shard_the_manifest_does_not_list_is_refused(capsys, base, tmp_path):
    run = copy_run(base, tmp_path)
    folder = step(run, 10)
    manifest = json.loads((folder / MANIFEST).read_text())
    del manifest["files"]["__1_0.distcp"]
    (folder / MANIFEST).write_text(json.dumps(manifest))
    shard = folder / "__1_0.distcp"
    raw = bytearray(shard.read_bytes())
    mid = len(raw) // 2
    raw[mid:mid + 16] = bytes(b ^ 0xFF for b in raw[mid:mid + 16])
    shard.write_bytes(bytes(raw))
    fragment = f"checkpoint {folder} is damaged: file __1_0.distcp is not in its manifest"
    line = refused(capsys, ["--resume", str(run), "--steps", "11", "--nproc", "1"], tmp_path)
    assert fragment in line, line
    line = refused(capsys, ["export", str(run), str(tmp_path / "out.pt")], tmp_path)
    assert fragment in line, line
    # Any file a load could read, whatever it is: a FIFO is named, never opened.
    (folder / "__1_0.distcp").unlink()
    os.mkfifo(folder / "__1_0.distcp")
    line = refused(capsys, ["export", str(folder), str(tmp_path / "out.pt")], tmp_path)
    assert fragment in line, line


# ------------------------------------------------------------ 2. export checks finiteness
def test_2_export_refuses_non_finite_values_as_resume_does(capsys, base, tmp_path):
    run = copy_run(base, tmp_path)
    folder = step(run, 10)
    weight = full_tensors(folder, ["model.tok_emb.weight"])["model.tok_emb.weight"]
    shard = folder / "__0_0.distcp"
    raw = bytearray(shard.read_bytes())
    at = bytes(raw).find(weight.numpy().tobytes()[:64])
    assert at > 0
    raw[at:at + 16] = b"\xff" * 16  # four float32 NaNs
    shard.write_bytes(bytes(raw))
    relist(folder)
    verify(folder)  # the checksums match: only the values are wrong
    problem = "tensor model.tok_emb.weight holds 4 non-finite values"
    line = refused(capsys, ["--resume", str(folder), "--steps", "11", "--nproc", "1"],
                   tmp_path)
    assert f"checkpoint {folder} is unusable: {problem}" in line, line
    line = refused(capsys, ["export", str(folder), str(tmp_path / "out.pt")], tmp_path)
    assert f"checkpoint {folder} is unusable: {problem}" in line, line
    assert not (tmp_path / "out.pt").exists()


# ----------------------------------------------- 3. an unreadable manifest in the newest step
@pytest.mark.slow
@pytest.mark.parametrize("how", ["not-json", "fifo"])
def test_3_an_unreadable_newest_manifest_is_named_and_its_folder_set_aside(
        capfd, base, tmp_path, how):
    run = copy_run(base, tmp_path)
    folder = step(run, 10)
    shards = {p.name: p.read_bytes() for p in folder.glob("*.distcp")}
    (folder / MANIFEST).unlink()
    if how == "fifo":
        os.mkfifo(folder / MANIFEST)
        why = f"its {MANIFEST} is a FIFO (named pipe), not a regular file"
    else:
        (folder / MANIFEST).write_text('{"format": "lab2-trainer-sharded-checkpoint",')
        why = f"its {MANIFEST} is not valid JSON"
    assert main(["--resume", str(run), "--nproc", "1"]) == 0  # from step 5 to 10
    err = capfd.readouterr().err
    (aside,) = (run / "ckpt").glob("step-000010.unreadable-*")
    said = [n for n in notes(err) if "step-000010" in n]
    assert len(said) == 1, err
    assert said[0].startswith(f"lab2-train: note: passed over {folder} ({why}"), said
    assert f"set it aside as {aside.name}" in said[0] and said[0].endswith(
        f"resuming from {step(run, 5)}"), said
    # The set-aside folder is as it was; the run saved step 10 anew beside it.
    assert {p.name: p.read_bytes() for p in aside.glob("*.distcp")} == shards
    verify(folder)


# ---------------------------------------------- 4. killed during the first save: no dead end
@pytest.mark.slow
def test_4_a_run_killed_in_its_first_save_starts_afresh(capsys, base, corpus_dir, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("settings.toml", "metrics.jsonl"):
        shutil.copy(base / name, run / name)
    partial = step(run, 5)
    shutil.copytree(step(base, 5), partial)
    for name in (MANIFEST, TRAINER_STATE, ".metadata"):
        (partial / name).unlink()  # DCP had written the shards only
    line = refused(capsys, ["--resume", str(run), "--nproc", "1"], tmp_path)
    assert f"{run / 'ckpt'} holds no complete checkpoint" in line, line
    assert "step-000005: an interrupted write: no manifest.json" in line, line
    assert "without --resume starts afresh" in line, line
    assert main([*SMALL, "--data", str(corpus_dir), "--steps", "5", "--nproc", "1",
                 "--out", str(run)]) == 0
    err = capsys.readouterr().err
    (aside,) = (run / "ckpt").glob("step-000005.partial-*")
    assert notes(err) == [
        f"lab2-train: note: set aside {partial} (an interrupted write: no manifest.json) as "
        f"{aside.name}: no complete checkpoint there, so this run starts afresh"], err
    assert sorted(p.name for p in aside.iterdir()) == ["__0_0.distcp", "__1_0.distcp"]
    verify(partial)  # the fresh run's own step 5
    steps = [json.loads(r)["step"] for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]


# ------------------------------------------- 5, 6. a resume over a partial step, saved again
@pytest.fixture(scope="module")
def over_partial(base, tmp_path_factory) -> tuple[Path, str]:
    """The base run with step 10 as a killed 2-rank write left it (shards, no manifest),
    resumed on 1 rank: (the run, its stderr)."""
    run = copy_run(base, tmp_path_factory.mktemp("partial"))
    (step(run, 10) / MANIFEST).unlink()
    return run, _main_stderr(["--resume", str(run), "--nproc", "1"])


def _main_stderr(argv: list[str]) -> str:
    """``main(argv)`` in this process, which must succeed; its stderr."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(argv)
    assert rc == 0, err.getvalue()
    return err.getvalue()


@pytest.mark.slow
def test_5_a_step_saved_again_starts_from_an_empty_folder(over_partial):
    run, _ = over_partial
    folder = step(run, 10)
    listed = json.loads((folder / MANIFEST).read_text())["files"]
    assert sorted(listed) == [".metadata", "__0_0.distcp", "trainer.pt"], listed
    assert sorted(p.name for p in folder.iterdir()) == [
        ".metadata", "__0_0.distcp", MANIFEST, "trainer.pt"]
    verify(folder)


@pytest.mark.slow
def test_6_a_resume_names_the_partial_step_it_passed_over(over_partial):
    run, err = over_partial
    # Once; and nothing on the layout: 2 ranks of zero1 (the default there) go on as 1 rank
    # of none, the default there.
    assert notes(err) == [f"lab2-train: note: passed over {step(run, 10)} (an interrupted "
                          f"write: no manifest.json); resuming from {step(run, 5)}"], err


def test_6_a_resume_from_an_older_step_names_the_newer_checkpoints_it_supersedes(base,
                                                                                tmp_path):
    from types import SimpleNamespace

    from lab2_trainer.checkpoint.folders import step_folder_notes

    run = copy_run(base, tmp_path)
    said = step_folder_notes(SimpleNamespace(out=str(run), resume=str(step(run, 5))))
    assert said == [f"resuming from {step(run, 5)} while {run / 'ckpt'} holds newer "
                    "checkpoints (step-000010): this run's first save supersedes them (they "
                    "are removed then, and --keep-last counts this run's checkpoints only)"], said
    assert step_folder_notes(SimpleNamespace(out=str(run), resume=str(step(run, 10)))) == []


# ------------------------------------------------------------ 7. FIFOs never block a save
@pytest.mark.slow
def test_7_a_fifo_named_like_a_shard_never_blocks_a_save(capsys, base, tmp_path):
    run = copy_run(base, tmp_path)
    folder = step(run, 10)
    (folder / MANIFEST).unlink()
    (folder / "__1_0.distcp").unlink()
    fifo = folder / "__1_0.distcp"
    os.mkfifo(fifo)
    # A save that opened the FIFO would wait for a writer forever: after the deadline one
    # comes (and goes at once), so that such a run ends, and fails here, instead of hanging.
    held = threading.Event()

    def unblock() -> None:
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))
            held.set()

    watchdog = threading.Timer(START_S / 2, unblock)
    watchdog.start()
    try:
        rc = main(["--resume", str(run), "--nproc", "1"])
    finally:
        watchdog.cancel()
    assert not held.is_set(), "the save blocked on a FIFO in its step folder"
    assert rc == 0, capsys.readouterr().err
    assert sorted(json.loads((folder / MANIFEST).read_text())["files"]) == [
        ".metadata", "__0_0.distcp", "trainer.pt"]
    verify(folder)


# ---------------------------------------------------------------- 8. export's output
def test_8_export_outputs_that_cannot_be_written_are_one_line(capsys, base, tmp_path):
    source = step(base, 10)
    place = tmp_path / "place"
    place.mkdir()
    os.mkfifo(place / "fifo")
    (place / "notes.txt").write_text("keep me")
    shard = source / "__0_0.distcp"
    kept = shard.read_bytes()
    cases = [
        (place / "fifo", "export output", "is a FIFO (named pipe)"),
        (place / "notes.txt" / "out.pt", "notes.txt is not a folder"),
        (place / ("a" * 300 + ".pt"), "more than the 255 a file name may have"),
        (f"{place / 'newdir'}/", "names a folder; export writes one file"),
        (shard, f"is inside the checkpoint {os.path.realpath(source)}"),
        (step(base, 5) / "other.pt", f"is inside the checkpoint {step(base, 5)}"),
        ("", "export output is empty"),
    ]
    for out, *fragments in cases:
        line = refused(capsys, ["export", str(base), str(out)], tmp_path)
        for fragment in fragments:
            assert fragment in line, (out, line)
    assert shard.read_bytes() == kept and not (place / "newdir").exists()
    verify(source)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder anyway")
def test_8_export_into_a_folder_it_cannot_write_is_one_line(capsys, base, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        line = refused(capsys, ["export", str(base), str(locked / "out.pt")], tmp_path)
    finally:
        locked.chmod(0o700)
    assert "is not writable" in line, line


# ------------------------------------------------------------------ 9. a diverged run
@pytest.mark.slow
def test_9_a_diverged_run_is_one_line_once(capfd, corpus_dir, tmp_path):
    rc = main([*SMALL, "--data", str(corpus_dir), "--steps", "20", "--nproc", "2",
               "--log-every", "1", "--lr", "1e30", "--out", str(tmp_path / "run")])
    lines = capfd.readouterr().err.strip().splitlines()
    assert rc == 1, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith("lab2-train: error: the loss became nan at step "), lines
    assert lines[0].endswith("(the run diverged): lower --lr (it is 1e+30)"), lines


# ------------------------------------------------------------------------ 10. smaller
def test_10_a_text_file_as_resume_is_not_a_checkpoint(capsys, tmp_path):
    (tmp_path / "notes.txt").write_text("hello, world\n")
    line = refused(capsys, ["--resume", str(tmp_path / "notes.txt"), "--nproc", "1"],
                   tmp_path)
    assert line == (f"lab2-train: error: cannot read checkpoint {tmp_path / 'notes.txt'}: not "
                    "a lab2-trainer checkpoint (it starts with b'hell'; torch.save writes a "
                    "zip archive)"), line


def test_10_plan_prints_small_counts_in_k_or_m(capsys):
    from lab2_trainer.cli.plan import count_text

    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "0.00 B parameters" not in out and " K parameters" in out, out
    assert [count_text(n) for n in (999, 713_600, 6.48e6, 1.97e9)] == [
        "999", "713.60 K", "6.48 M", "1.97 B"]


def test_10_a_new_rank_count_says_the_layout_it_chose(base, tmp_path):
    """A zero2 checkpoint resumed on another number of ranks (the issue's 3; here 4, which
    the batch of 8 divides) runs as zero1, the default there: said."""
    import torch

    run = copy_run(base, tmp_path)
    folder = step(run, 5)
    small = torch.load(folder / TRAINER_STATE, weights_only=True)
    small.pop("checksums")
    small["settings"]["sharding"] = "zero2"
    torch.save(integrity.seal(small), folder / TRAINER_STATE)
    relist(folder)
    said: list[str] = []
    given = given_settings(build_parser().parse_args(["--resume", str(folder), "--nproc", "4"]))
    settings, _ = resolve_settings(given, "cpu", notes=said)
    assert settings.sharding == "zero1"
    assert said == [f"{folder} was saved by 2 rank(s) with --sharding zero2 --ddp none; on 4 "
                    "rank(s) the layout is chosen afresh: --sharding zero1 --ddp none (pass "
                    "--sharding zero2 to keep it)"], said


def test_10_eps_zero_is_refused(capsys, corpus_dir, tmp_path):
    line = refused(capsys, [*SMALL, "--data", str(corpus_dir), "--eps", "0", "--out",
                            str(tmp_path / "run")], tmp_path)
    assert "--eps must be > 0 for training, got 0.0" in line, line
