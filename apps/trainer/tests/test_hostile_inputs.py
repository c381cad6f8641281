"""Hostile input, second pass: each scenario of the run-integrity review that did not hold,
tried as a hostile user would. The real ``lab2-train`` in a subprocess, run in an empty
folder: exit code 2, exactly one stderr line naming the problem, nothing written. Variants
of a finding run through ``main()`` in this process (the same code path, without a
torch import per case).

1. argparse errors; 2. integers past int64; 3. an absurd layer count; 4. ``--timeout``
past what ``timedelta`` holds; 5. an unknown compile backend or mode; 6. a TOML preset
that is not a string; 7. a plain pickle as ``--resume``; 8. checkpoint fields with good
checksums and bad content; 9. an unreadable claim file; 10. a resume keeps its run's
settings; 11. a resume to a step not beyond the checkpoint; 12. a stopped rank when the
launcher is killed leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lab2_testing.cli import folder_listing, one_error_line, refused_here
from lab2_testing.procs import children, running, wait_for
from lab2_trainer.checkpoint import single_file as integrity
from lab2_trainer.checkpoint.folders import (
    MANIFEST,
    TRAINER_STATE,
    file_crc,
    load_trainer_state,
    newest_step,
    write_manifest,
)
from lab2_trainer.cli.main import main

torch.set_num_threads(1)

#: The review's tiny run.
B = ["--steps", "3", "--batch-size", "4", "--d-model", "32", "--n-layers", "1", "--n-heads",
     "2", "--d-ff", "64", "--context-length", "32", "--eval-batches", "1", "--eval-every", "0",
     "--sample-tokens", "0", "--no-plot", "--quiet"]
CMD = [sys.executable, "-c", "import sys; from lab2_trainer.cli.main import main; sys.exit(main())"]
START_S = 180  # a fresh interpreter importing torch on a loaded 2-core machine


def _env(tmp: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if tmp is not None:
        env["TMPDIR"] = str(tmp)
    return env


def lab2_train(args: list[str], cwd: Path, timeout: float = START_S,
               tmp: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CMD, *args], cwd=cwd, env=_env(tmp), capture_output=True,
                          text=True, timeout=timeout)


def refused(args: list[str], folder: Path, *fragments: str) -> str:
    """The command, run in ``folder``: exit 2, one line holding every fragment, and
    ``folder`` unchanged."""
    folder.mkdir(parents=True, exist_ok=True)
    before = folder_listing(folder)
    proc = lab2_train(args, folder)
    line = one_error_line(proc.returncode, proc.stderr, fragments)
    assert folder_listing(folder) == before, "something was written"
    return line


@pytest.fixture(scope="module")
def finished(corpus_dir, tmp_path_factory) -> Path:
    """A finished one-rank run of 2 steps with every output setting away from its default
    (and a checkpoint at each step)."""
    out = tmp_path_factory.mktemp("runs") / "A"
    rc = main([*B, "--data", str(corpus_dir), "--nproc", "1", "--steps", "2", "--eval-every",
               "1", "--eval-batches", "2", "--sample-tokens", "4", "--ckpt-every", "1",
               "--log-every", "1", "--out", str(out)])
    assert rc == 0
    # Its checkpoint as one file too (the single-file format, which --resume also takes).
    assert main(["export", str(out), str(out.parent / "A.pt")]) == 0
    return out


def _copy(run: Path, tmp_path: Path, name: str = "run") -> Path:
    dest = tmp_path / name
    shutil.copytree(run, dest)
    return dest


def _edited(run: Path, tmp_path: Path, edit) -> Path:
    """The run's exported checkpoint edited and sealed again (good checksums, bad content),
    alone in a folder."""
    ckpt = torch.load(run.parent / "A.pt", weights_only=True)
    edit(ckpt)
    ckpt.pop("checksums")
    folder = tmp_path / "edited"
    folder.mkdir()
    torch.save(integrity.seal(ckpt), folder / "ckpt.pt")
    return folder


def _edited_step(run: Path, tmp_path: Path, edit) -> Path:
    """The run's last step folder with its trainer.pt edited and sealed again, and a
    manifest that matches (good checksums, bad content)."""
    folder = tmp_path / "edited" / "step-000002"
    shutil.copytree(newest_step(run / "ckpt"), folder)
    small = torch.load(folder / TRAINER_STATE, weights_only=True)
    small.pop("checksums")
    edit(small)
    torch.save(integrity.seal(small), folder / TRAINER_STATE)
    files = json.loads((folder / MANIFEST).read_text())["files"]
    write_manifest(folder, 2, {name: file_crc(folder / name) for name in files})
    return folder


# ------------------------------------------------------------- 1. argparse errors
@pytest.mark.parametrize(("extra", "fragment"), [
    (["--steps", "nan"], "argument --steps: invalid int value: 'nan'"),
    (["--steps", "1.5"], "argument --steps: invalid int value: '1.5'"),
    (["--frobnicate", "3"], "unrecognized arguments: --frobnicate 3"),
    (["--precision", "fp4"], "argument --precision: invalid choice: 'fp4'"),
], ids=["nan", "fraction", "unknown-flag", "bad-choice"])
def test_1_argparse_errors_are_one_line_naming_the_flag(tmp_path, extra, fragment):
    refused([*B, *extra], tmp_path / "case", fragment, "--help")


# ------------------------------------------------------------- 2. integers past int64
def test_2_integers_past_int64_are_refused(capsys, monkeypatch, tmp_path):
    big = "100000000000000000000"
    refused([*B, "--d-model", big], tmp_path / "case", "d_model must be < 2**63")
    for name in ("d-ff", "context-length", "vocab-size"):
        refused_here(capsys, monkeypatch, [*B, f"--{name}", big], tmp_path / name,
                     f"{name.replace('-', '_')} must be < 2**63")
    refused_here(capsys, monkeypatch, [*B, "--ckpt-threads", "0"], tmp_path / "threads",
                 "--ckpt-threads must be >= 1")
    # Inside int64, but the products overflow it: the memory check, by arithmetic.
    refused_here(capsys, monkeypatch, [*B, "--d-model", str(2**62)], tmp_path / "2**62",
                 "parameters", "of memory")


# ------------------------------------------------------------- 3. an absurd layer count
def test_3_absurd_layer_counts_are_refused_at_once(capsys, monkeypatch, tmp_path):
    start = time.monotonic()
    refused([*B, "--n-layers", "1000000000000"], tmp_path / "case",
            "10,304,000,000,016,416 parameters", "of memory")
    assert time.monotonic() - start < 100  # a fresh interpreter's start, no work per layer
    from lab2_trainer.cli import checks

    monkeypatch.setattr(checks, "available_memory", lambda: 8 * 1024**3)
    start = time.monotonic()
    refused_here(capsys, monkeypatch, [*B, "--n-layers", "100000"], tmp_path / "1e5",
                 "1,030,416,416 parameters")
    assert time.monotonic() - start < 5


def test_3_the_parameter_count_is_the_model_s():
    from lab2_trainer.config import model_config
    from lab2_trainer.models.shapes import parameter_count
    from lab2_trainer.models.transformer import shape_model

    for norm in ("tritonnorm", "layernorm"):
        for ffn in ("swiglu", "gelu"):
            for tie in (False, True):
                config = model_config("tiny", norm=norm, ffn=ffn, tie_embeddings=tie,
                                      vocab_size=300)
                assert parameter_count(config) == sum(
                    p.numel() for p in shape_model(config).parameters())


# ------------------------------------------------------------- 4. --timeout
def test_4_a_timeout_past_what_timedelta_holds_is_refused(capsys, monkeypatch, tmp_path):
    refused([*B, "--timeout", "1e308"], tmp_path / "case",
            "--timeout must be > 0 and at most 31,536,000")
    refused_here(capsys, monkeypatch, [*B, "--timeout", "4e7"], tmp_path / "4e7",
                 "--timeout must be > 0")


# ------------------------------------------------------------- 5. compile backend and mode
def test_5_an_unknown_compile_backend_or_mode_is_refused(capsys, monkeypatch, tmp_path):
    refused([*B, "--compile", "--compile-backend", "bogus"], tmp_path / "case",
            "--compile-backend 'bogus' is not a torch.compile backend", "aot_eager")
    refused_here(capsys, monkeypatch, [*B, "--compile", "--compile-mode", "bogus"],
                 tmp_path / "mode", "--compile-mode 'bogus' is not one of inductor's modes")
    refused_here(capsys, monkeypatch, [*B, "--compile", "--compile-backend", "aot_eager",
                                       "--compile-mode", "max-autotune"], tmp_path / "both",
                 "takes none")


# ------------------------------------------------------------- 6. TOML preset
def test_6_a_toml_preset_that_is_not_a_string_is_refused(capsys, monkeypatch, tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('preset = ["tiny"]\n')
    refused(["--config", str(config), *B], tmp_path / "case", "preset must be a string")
    config.write_text("preset = {a = 1}\n")
    refused_here(capsys, monkeypatch, ["--config", str(config), *B], tmp_path / "table",
                 "preset must be a string")
    config.write_text("lr = 1" + "0" * 400 + "\n")  # an integer no float holds
    refused_here(capsys, monkeypatch, ["--config", str(config), *B], tmp_path / "huge",
                 "lr must be a finite number")


# ------------------------------------------------------------- 7. a plain pickle
def test_7_a_plain_pickle_as_resume_is_one_line(tmp_path):
    case = tmp_path / "case"
    case.mkdir()
    (case / "ckpt.pt").write_bytes(pickle.dumps({"a": {1, 2}}, protocol=4))
    refused(["--resume", "ckpt.pt"], case, "cannot read checkpoint ckpt.pt",
            "not a lab2-trainer checkpoint")


# ------------------------------------------------------------- 8. bad checkpoint content
def test_8_bad_optimizer_betas_are_refused_in_the_launcher(finished, tmp_path):
    folder = _edited(finished, tmp_path,
                     lambda c: c["optimizer"]["param_groups"][0].update(betas=(0.9,)))
    refused(["--resume", str(folder), "--steps", "5"], folder,
            "optimizer param group 0: betas must be two numbers in [0, 1)")


@pytest.mark.parametrize(("edit", "fragment"), [
    (lambda c: c["optimizer"]["state"][0].update(
        exp_avg=c["optimizer"]["state"][0]["exp_avg"].tolist()), "'exp_avg' of parameter 0"),
    (lambda c: c["optimizer"]["state"][0].update(exp_avg=torch.zeros(())),
     "exp_avg is a torch.float32 tensor of shape []"),
    (lambda c: c["optimizer"]["state"][1].pop("exp_avg_sq"), "AdamW's is"),
    (lambda c: c["optimizer"]["state"][1].update(step=torch.tensor(-1.0)),
     "step must be one finite number"),
    (lambda c: c["optimizer"]["param_groups"][1].update(betas=(0.9, 0.5)),
     "differ from the run's"),
    (lambda c: c["optimizer"]["param_groups"][0].update(amsgrad=True), "amsgrad=True"),
    (lambda c: c.update(gradient_order=[0, 0, 1]), "gradient_order must be a permutation"),
    (lambda c: c.update(gradient_order="abc"), "gradient_order must be a permutation"),
    (lambda c: c.update(scaler={"scale": -1.0}), "gradient scaler state"),
], ids=["exp_avg-list", "exp_avg-scalar", "state-key", "step-negative", "betas-other",
        "amsgrad", "order-repeats", "order-text", "scaler"])
def test_8_bad_checkpoint_content_is_refused_in_the_launcher(capsys, monkeypatch, finished,
                                                             tmp_path, edit, fragment):
    folder = _edited(finished, tmp_path, edit)
    refused_here(capsys, monkeypatch, ["--resume", str(folder), "--steps", "5"], folder,
                 fragment, str(folder))


@pytest.mark.parametrize(("edit", "fragment"), [
    (lambda c: c["optimizer_groups"][1].update(betas=(0.9, 0.5)), "differ from the run's"),
    (lambda c: c["optimizer_groups"][0].update(amsgrad=True), "amsgrad=True"),
    (lambda c: c.update(gradient_order=[0, 0, 1]), "gradient_order must be a permutation"),
    (lambda c: c.update(scaler={"scale": -1.0}), "gradient scaler state"),
    (lambda c: c["rng_by_rank"].update(world_size=2), "random states of 2 rank(s)"),
    (lambda c: c["rng_by_rank"]["ranks"][0].update(cpu=torch.zeros(3)),
     "rank 0's CPU random state is unusable"),
], ids=["betas-other", "amsgrad", "order-repeats", "scaler", "rng-ranks", "rng-rank-state"])
def test_8_bad_sharded_checkpoint_content_is_refused_in_the_launcher(
        capsys, monkeypatch, finished, tmp_path, edit, fragment):
    folder = _edited_step(finished, tmp_path, edit)
    refused_here(capsys, monkeypatch, ["--resume", str(folder), "--steps", "5"], folder,
                 fragment, str(folder))


# ------------------------------------------------------------- 9. an unreadable claim
def test_9_an_unreadable_claim_is_taken_over_with_a_note(capsys, monkeypatch, corpus_dir,
                                                         tmp_path):
    from lab2_trainer.runtime.run_folder import LOCK_NAME

    old = time.time() - 3600
    for content, name in ((b"\x00garbage{", "garbage"), (b"", "empty")):
        out = tmp_path / name
        out.mkdir()
        (out / LOCK_NAME).write_bytes(content)
        os.utime(out / LOCK_NAME, (old, old))
        args = [*B, "--data", str(corpus_dir), "--nproc", "1", "--out", str(out)]
        if name == "garbage":
            proc = lab2_train(args, tmp_path)
            rc, err = proc.returncode, proc.stderr
        else:
            rc, err = main(args), capsys.readouterr().err
        assert rc == 0, err
        assert err.strip().splitlines() == [
            f"lab2-train: note: took over {out}, whose claim file could not be read (empty "
            f"or damaged, {LOCK_NAME}) and was not locked by any process"], err
        assert newest_step(out / "ckpt") is not None and not (out / LOCK_NAME).exists()


# ------------------------------------------------------------- 10. resume keeps the run's settings
def test_10_a_resume_keeps_every_setting_of_its_run(finished, tmp_path):
    run = _copy(finished, tmp_path)
    before = (run / "settings.toml").read_text()
    proc = lab2_train(["--resume", "run", "--steps", "4"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    changed = {a: b for a, b in zip(before.splitlines(), (run / "settings.toml").read_text()
                                    .splitlines()) if a != b and not a.startswith("out =")}
    assert changed == {"steps = 2": "steps = 4"}
    records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all("val_loss" in r for r in records)  # --eval-every 1, kept
    assert (run / "sample.txt").is_file() and not (run / "loss_curve.png").exists()
    assert load_trainer_state(newest_step(run / "ckpt"))["step"] == 4
    # What the optimizer state fixes cannot be changed; the same value may be given.
    run2 = _copy(finished, tmp_path, "run2")
    refused(["--resume", "run2", "--steps", "4", "--beta1", "0.5"], tmp_path,
            "was trained with --beta1 0.9", "drop --beta1")
    refused(["--resume", "run2", "--steps", "4", "--weight-decay", "0"], tmp_path,
            "--weight-decay 0.1")
    assert (run2 / "settings.toml").read_text() == before


def test_10_the_rank_layout_is_kept_or_resolved_afresh_as_a_whole():
    from lab2_trainer.cli.main import resumed_settings
    from lab2_trainer.config import TrainSettings

    saved = TrainSettings(nproc=2, ddp="bucketed", sharding="zero1-allreduce", eval_every=7,
                          device_type="cpu")
    kept = resumed_settings(saved, {}, "cpu", None)
    assert (kept["nproc"], kept["ddp"], kept["sharding"], kept["eval_every"]) == (
        2, "bucketed", "zero1-allreduce", 7)
    for explicit, device, world in (({"nproc": 1}, "cpu", None), ({}, "cuda", None),
                                    ({}, "cpu", 4), ({"sharding": "zero2"}, "cpu", None)):
        fresh = resumed_settings(saved, explicit, device, world)
        assert {k: fresh[k] for k in ("nproc", "ddp", "sharding")} == {
            "nproc": None, "ddp": None, "sharding": None, **explicit}
        assert fresh["eval_every"] == 7
    # 0.4's zero1 behind a DDP wrapper is today's zero1-allreduce.
    old = TrainSettings(nproc=2, ddp="bucketed", sharding="zero1", device_type="cpu")
    assert resumed_settings(old, {}, "cpu", None)["sharding"] == "zero1-allreduce"


# ------------------------------------------------------------- 11. a resume to nowhere
def test_11_a_resume_not_beyond_the_checkpoint_is_refused(capsys, monkeypatch, finished,
                                                          tmp_path):
    _copy(finished, tmp_path)
    refused(["--resume", "run", "--steps", "2"], tmp_path,
            "is at step 2, --steps 2 is not beyond it", "--steps N with N > 2")
    refused_here(capsys, monkeypatch, ["--resume", "run"], tmp_path,
                 "is at step 2, the end of its run (steps = 2)")


# ------------------------------------------------------------- 12. nothing left behind
@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_12_a_stopped_rank_and_a_killed_launcher_leave_nothing_behind(world_size, corpus_dir,
                                                                      tmp_path):
    """SIGSTOP a rank, then SIGKILL the launcher: both ranks go within seconds and no
    rendezvous folder stays. A folder that a dead launcher left earlier (its owner file
    names a pid that has exited) is swept when this run starts; a live one's is kept.
    (Two ranks: run once, in the world-size-2 cell of the Gloo matrix.)"""
    if world_size != 2:
        pytest.skip("the scenario is two ranks")
    import socket

    from lab2_trainer.runtime.supervise import OWNER_NAME

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale, live = tmp_path / "lab2-train-rdzv-stale", tmp_path / "lab2-train-rdzv-live"
    for folder, pid in ((stale, dead.pid), (live, os.getpid())):
        folder.mkdir()
        (folder / OWNER_NAME).write_text(json.dumps({
            "kind": "lab2bench.ranks.RankGroup rendezvous", "pid": pid,
            "host": socket.gethostname()}))
    out = tmp_path / "run"
    launcher = subprocess.Popen(
        [*CMD, *B, "--data", str(corpus_dir), "--nproc", "2", "--steps", "100000", "--out",
         str(out)], env=_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    ranks: list[int] = []
    try:
        wait_for(lambda: (out / "metrics.jsonl").is_file(), START_S, "the first steps")
        ranks = wait_for(lambda: children(launcher.pid, count=2),
                          10, "the ranks")
        assert not stale.exists() and live.exists()
        os.kill(ranks[1], signal.SIGSTOP)
        time.sleep(0.5)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        killed = time.monotonic()
        wait_for(lambda: not any(map(running, ranks)), 15, "the ranks to die")
        assert time.monotonic() - killed < 10
    finally:
        for pid in [launcher.pid, *ranks]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.wait(timeout=30)
    assert [p.name for p in tmp_path.glob("lab2-train-rdzv-*")] == [live.name]
