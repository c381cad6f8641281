"""Bad input stopped in the launcher, before any rank starts: one line on stderr, exit
code 2, nothing written. Damaged and unfit checkpoints (single files, and step folders:
a flipped, truncated or missing shard, a missing manifest), non-finite or out-of-range float
flags, negative token ids, ``--out`` naming a file, a model too large for the machine;
and the output folder's claim (held, stale, from another host)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lab2_testing.cli import folder_listing
from lab2_trainer.checkpoint import single_file as integrity
from lab2_trainer.checkpoint.folders import (
    MANIFEST,
    TRAINER_STATE,
    file_crc,
    load_trainer_state,
    write_manifest,
)
from lab2_trainer.checkpoint.single_file import load_checkpoint
from lab2_trainer.cli.main import build_parser, given_settings, main, resolve_settings
from lab2_trainer.config import UsageError
from lab2_trainer.runtime.launch import DistContext
from lab2_trainer.runtime.run_folder import LOCK_NAME, claim_folder, clean_stale_temporaries
from lab2_trainer.training.loop import Trainer

torch.set_num_threads(1)

TINY = ["--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--d-ff", "64",
        "--context-length", "32", "--batch-size", "8", "--eval-batches", "2",
        "--sample-tokens", "0", "--quiet", "--no-plot"]


def run_bad(capsys, argv: list[str], root: Path) -> str:
    """``main(argv)`` must exit 2 with one line on stderr and change nothing under root."""
    before = folder_listing(root)
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lab2-train: error: "), err
    assert folder_listing(root) == before, "something was written"
    return lines[0]


@pytest.fixture(scope="module")
def run_dir(corpus_dir, tmp_path_factory) -> Path:
    """A finished one-rank run (with a checkpoint) of the tiny model, and its checkpoint
    exported to one file beside it (``done.pt``, the single-file format)."""
    out = tmp_path_factory.mktemp("runs") / "done"
    assert main([*TINY, "--data", str(corpus_dir), "--nproc", "1", "--steps", "2",
                 "--out", str(out)]) == 0
    assert main(["export", str(out), str(out.parent / "done.pt")]) == 0
    return out


def _single(run_dir: Path) -> Path:
    return run_dir.parent / "done.pt"


def _step(run_dir: Path) -> Path:
    return run_dir / "ckpt" / "step-000002"


def _damaged_copy(run_dir: Path, tmp_path: Path, edit) -> Path:
    """A copy of the run's single-file checkpoint, edited in memory and saved again
    (sealed)."""
    ckpt = torch.load(_single(run_dir), weights_only=True)
    edit(ckpt)
    ckpt.pop("checksums")
    folder = tmp_path / "edited"
    folder.mkdir()
    torch.save(integrity.seal(ckpt), folder / "ckpt.pt")
    return folder / "ckpt.pt"


def _edited_step(run_dir: Path, tmp_path: Path, edit) -> Path:
    """A copy of the run's step folder whose trainer.pt is edited and sealed again, with
    a manifest that matches (good checksums, bad content)."""
    folder = tmp_path / "edited" / "step-000002"
    shutil.copytree(_step(run_dir), folder)
    small = torch.load(folder / TRAINER_STATE, weights_only=True)
    small.pop("checksums")
    edit(small)
    torch.save(integrity.seal(small), folder / TRAINER_STATE)
    manifest = json.loads((folder / MANIFEST).read_text())
    files = {name: file_crc(folder / name) for name in manifest["files"]}
    write_manifest(folder, manifest["step"], files)
    return folder


# ------------------------------------------------------------- damaged checkpoints
def test_flipped_payload_bytes_are_caught_naming_the_tensor(capsys, run_dir, tmp_path):
    """The issue's case: 64 bytes of tok_emb.weight overwritten (16 NaNs) in the file."""
    bad = tmp_path / "ckpt.pt"
    raw = bytearray(_single(run_dir).read_bytes())
    weight = torch.load(_single(run_dir), weights_only=True)["model"]["tok_emb.weight"]
    at = bytes(raw).find(weight.numpy().tobytes()[:256])
    assert at > 0
    raw[at + 1024:at + 1088] = b"\xff" * 64
    bad.write_bytes(bytes(raw))
    line = run_bad(capsys, ["--resume", str(bad), "--nproc", "1"], tmp_path)
    assert str(bad) in line and "damaged" in line
    assert "tensor model/tok_emb.weight does not match its checksum" in line
    # Found the same way by the command itself, in a fresh process.
    proc = subprocess.run([sys.executable, "-c", "import sys; from lab2_trainer.cli.main import "
                           "main; sys.exit(main())", "--resume", str(bad), "--nproc", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [line], proc.stderr


def test_flipped_shard_bytes_are_caught_naming_the_file(capsys, run_dir, tmp_path):
    """The same 64 bytes overwritten in the step folder's shard file."""
    folder = tmp_path / "ckpt" / "step-000002"
    shutil.copytree(_step(run_dir), folder)
    shard = folder / "__0_0.distcp"
    raw = bytearray(shard.read_bytes())
    weight = torch.load(_single(run_dir), weights_only=True)["model"]["tok_emb.weight"]
    at = bytes(raw).find(weight.numpy().tobytes()[:256])
    assert at > 0
    raw[at + 1024:at + 1088] = b"\xff" * 64
    shard.write_bytes(bytes(raw))
    line = run_bad(capsys, ["--resume", str(folder), "--nproc", "1"], tmp_path)
    assert str(folder) in line and "damaged" in line
    assert "file __0_0.distcp does not match its checksum" in line


def test_non_finite_weights_with_good_checksums_are_refused(capsys, run_dir, tmp_path):
    def poison(ckpt):
        ckpt["optimizer"]["state"][1]["exp_avg_sq"].view(-1)[5] = float("inf")
    bad = _damaged_copy(run_dir, tmp_path, poison)
    line = run_bad(capsys, ["--resume", str(bad), "--nproc", "1"], tmp_path)
    assert "tensor optimizer/state/1/exp_avg_sq holds 1 non-finite value" in line
    assert str(bad) in line


def test_non_finite_shards_with_good_checksums_are_refused(capsys, run_dir, tmp_path):
    """A sharded checkpoint written by a run whose AdamW state held an infinity."""
    given = given_settings(build_parser().parse_args(
        ["--resume", str(run_dir), "--steps", "3", "--nproc", "1",
         "--out", str(tmp_path / "poisoned")]))
    settings, _ = resolve_settings(given, "cpu")
    trainer = Trainer(settings, DistContext())
    with torch.no_grad():
        trainer.optimizer.state[trainer.model.tok_emb.weight]["exp_avg_sq"].view(-1)[5] = \
            float("inf")
    trainer.save_checkpoint()
    trainer.checkpointer.finish()
    folder = tmp_path / "poisoned" / "ckpt" / "step-000002"
    line = run_bad(capsys, ["--resume", str(folder), "--nproc", "1", "--out",
                            str(tmp_path / "again")], tmp_path)
    assert "tensor optim.tok_emb.weight.exp_avg_sq holds 1 non-finite value" in line
    assert str(folder) in line


@pytest.mark.parametrize(("edit", "fragment"), [
    (lambda c: c["optimizer"]["state"][0].update(exp_avg=torch.zeros(3, 3)),
     "'exp_avg' of parameter 0 in param group 0 has shape [3, 3]"),
    (lambda c: c["optimizer"]["param_groups"][0].pop("betas"), "lacks 'betas'"),
    (lambda c: c["rng"].update(cpu=torch.zeros(7, dtype=torch.uint8)),
     "its CPU random state is unusable"),
    (lambda c: c["rng"].update(cpu=torch.zeros(5056)), "its CPU random state is unusable"),
    (lambda c: c["model"].update({"tok_emb.weight": torch.zeros(31, 32)}),
     "model tensor tok_emb.weight is [31, 32]"),
    (lambda c: c["sampler"].update(draws=-3), "sampler position"),
], ids=["optimizer-shape", "another-optimizer", "rng-size", "rng-dtype", "model-shape",
        "sampler"])
def test_checkpoints_that_do_not_fit_are_refused(capsys, run_dir, tmp_path, edit, fragment):
    bad = _damaged_copy(run_dir, tmp_path, edit)
    line = run_bad(capsys, ["--resume", str(bad), "--nproc", "1"], tmp_path)
    assert fragment in line and str(bad) in line


@pytest.mark.parametrize(("edit", "fragment"), [
    (lambda c: c["optimizer_groups"][0].pop("betas"), "lacks 'betas'"),
    (lambda c: c["rng"].update(cpu=torch.zeros(7, dtype=torch.uint8)),
     "its CPU random state is unusable"),
    (lambda c: c["sampler"].update(draws=-3), "sampler position"),
    (lambda c: c.update(step=-1), "its step -1 is not an integer >= 0"),
], ids=["another-optimizer", "rng-size", "sampler", "step"])
def test_sharded_checkpoints_that_do_not_fit_are_refused(capsys, run_dir, tmp_path, edit,
                                                         fragment):
    bad = _edited_step(run_dir, tmp_path, edit)
    line = run_bad(capsys, ["--resume", str(bad), "--nproc", "1"], tmp_path)
    assert fragment in line and str(bad) in line


@pytest.mark.parametrize("damage", ["missing-manifest", "truncated", "missing-shard",
                                    "missing-metadata"])
def test_incomplete_step_folders_are_refused(capsys, run_dir, tmp_path, damage):
    folder = tmp_path / "ckpt" / "step-000002"
    shutil.copytree(_step(run_dir), folder)
    if damage == "missing-manifest":
        (folder / MANIFEST).unlink()
        fragment = f"has no {MANIFEST}: not a complete checkpoint"
    elif damage == "truncated":
        shard = folder / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[:1000])
        fragment = "file __0_0.distcp is truncated (1,000 bytes, the manifest says"
    elif damage == "missing-shard":
        (folder / "__0_0.distcp").unlink()
        fragment = "file __0_0.distcp is missing"
    else:
        (folder / ".metadata").unlink()
        fragment = "file .metadata is missing"
    line = run_bad(capsys, ["--resume", str(folder), "--nproc", "1"], tmp_path)
    assert fragment in line and str(folder) in line
    # Named by its ckpt/ folder, a folder without a manifest is no checkpoint at all.
    if damage == "missing-manifest":
        line = run_bad(capsys, ["--resume", str(tmp_path / "ckpt"), "--nproc", "1"], tmp_path)
        assert "holds no complete checkpoint" in line


def test_sealed_checkpoints_round_trip_and_old_ones_still_load(run_dir, tmp_path):
    ckpt = load_checkpoint(_single(run_dir))
    assert ckpt["version"] == 2 and integrity.first_damage(ckpt) is None
    ckpt["settings"]["lr"] = 1.0  # a changed setting is caught too
    assert "settings and counters" in integrity.first_damage(ckpt)
    old = dict(torch.load(_single(run_dir), weights_only=True), version=1)
    old.pop("checksums")
    torch.save(old, tmp_path / "v1.pt")
    assert load_checkpoint(tmp_path / "v1.pt")["version"] == 1
    # A sharded checkpoint's small state is sealed the same way.
    small = load_trainer_state(_step(run_dir))
    assert small["sharded"] and integrity.first_damage(small) is None


# ------------------------------------------------------------- flags and data
@pytest.mark.parametrize(("extra", "fragment"), [
    (["--clip", "nan"], "--clip must be a finite number"),
    (["--lr", "inf"], "--lr must be a finite number"),
    (["--weight-decay", "inf"], "--weight-decay must be a finite number"),
    (["--bucket-mb", "nan"], "--bucket-mb must be a finite number"),
    (["--min-lr=-1e-3"], "--min-lr must be in [0, --lr"),
    (["--clip", "-1"], "--clip must be >= 0"),
    (["--timeout", "0"], "--timeout must be > 0"),
    (["--timeout", "inf"], "--timeout must be a finite number"),
    (["--seed", "-1"], "--seed must be in [0, 2**63)"),
    (["--eps", "nan"], "eps must be a finite number >= 0"),
])
def test_non_finite_and_out_of_range_flags(capsys, corpus_dir, tmp_path, extra, fragment):
    line = run_bad(capsys, [*TINY, "--data", str(corpus_dir), "--out", str(tmp_path / "o"),
                            *extra], tmp_path)
    assert fragment in line


def test_out_naming_a_file_or_below_one(capsys, corpus_dir, tmp_path):
    afile = tmp_path / "results.txt"
    afile.write_text("keep me")
    for out in (afile, afile / "run"):
        line = run_bad(capsys, [*TINY, "--data", str(corpus_dir), "--out", str(out)], tmp_path)
        assert "is a file" in line or "is not a folder" in line
    assert afile.read_text() == "keep me"


def test_negative_token_ids(capsys, tmp_path):
    tokens = (np.arange(4000) % 50).astype(np.int32)
    tokens[1234] = -7
    np.save(tmp_path / "toks.npy", tokens)
    line = run_bad(capsys, [*TINY, "--data", str(tmp_path / "toks.npy"), "--vocab-size", "50",
                            "--out", str(tmp_path / "o")], tmp_path)
    assert "negative token id -7 (at position 1234)" in line


def test_a_model_larger_than_the_machine(capsys, tmp_path):
    np.save(tmp_path / "toks.npy", (np.arange(4000) % 50).astype(np.uint16))
    line = run_bad(capsys, [*TINY, "--data", str(tmp_path / "toks.npy"), "--vocab-size",
                            "1000000000", "--out", str(tmp_path / "o")], tmp_path)
    assert "64,000,020,640 parameters" in line and "available" in line


# ------------------------------------------------------------- the output folder's claim
def test_claims_held_stale_and_foreign(tmp_path):
    out = tmp_path / "run"
    with claim_folder(out) as claim:
        info = json.loads((out / LOCK_NAME).read_text())
        assert info["pid"] == os.getpid() and info["host"] == socket.gethostname()
        with pytest.raises(UsageError, match=f"in use by another run \\(pid {os.getpid()}"):
            claim_folder(out)  # another open file: the lock is held
        assert claim.took_over is None
    assert not (out / LOCK_NAME).exists()
    # Stale: a pid that has exited, on this host.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    with claim_folder(out) as claim:
        assert claim.took_over["pid"] == dead.pid
        assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
    # Live (this very process) but not locked, and another host's: both refused.
    for owner, fragment in (({"pid": os.getpid(), "host": socket.gethostname()}, "in use"),
                            ({"pid": 1, "host": "elsewhere"}, "cannot be checked")):
        (out / LOCK_NAME).write_text(json.dumps(owner))
        with pytest.raises(UsageError, match=fragment):
            claim_folder(out)
        assert json.loads((out / LOCK_NAME).read_text()) == owner  # left alone
    # A lock that is a symlink is not followed (a takeover would truncate its target).
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    (out / LOCK_NAME).unlink()
    (out / LOCK_NAME).symlink_to(precious)
    with pytest.raises(UsageError, match="cannot claim"):
        claim_folder(out)
    assert precious.read_text() == "keep me"


def test_stale_temporaries_are_removed_only_when_their_writer_is_gone(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    names = [f".ckpt.pt.{dead.pid}.tmp", f".metrics.jsonl.{os.getpid()}.tmp",
             f".loss_curve.{dead.pid}.tmp.png", "ckpt.pt", ".hidden", "notes.tmp"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    assert sorted(clean_stale_temporaries(tmp_path, only_dead_writers=True)) == [
        f".ckpt.pt.{dead.pid}.tmp", f".loss_curve.{dead.pid}.tmp.png"]
    assert clean_stale_temporaries(tmp_path, only_dead_writers=False) == [
        f".metrics.jsonl.{os.getpid()}.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hidden", "ckpt.pt", "notes.tmp"]
