"""Sharded checkpoints in one process: the background write overlaps training and writes
the same files as a foreground one; ``kill -9`` in the middle of a background write
leaves the previous checkpoint, which resumes bit for bit; ``--keep-last`` and the newest
complete step; the export loads into a plain model and a plain ``torch.optim.AdamW``."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from lab2_testing.ddp_testkit import bitwise_equal
from lab2_testing.procs import wait_for
from lab2_trainer.checkpoint import writer as checkpoint_writer
from lab2_trainer.checkpoint.export import export
from lab2_trainer.checkpoint.folders import (
    MANIFEST,
    load_trainer_state,
    newest_step,
    resolve,
)
from lab2_trainer.checkpoint.parts import saved_tensors
from lab2_trainer.cli.main import main
from lab2_trainer.config import ModelConfig, TrainSettings
from lab2_trainer.models.transformer import TransformerLM
from lab2_trainer.parallel.parallelize import param_groups
from lab2_trainer.runtime.launch import DistContext
from lab2_trainer.training import loop as train_module
from lab2_trainer.training.loop import Trainer

torch.set_num_threads(1)


def settings(data, out, **overrides) -> TrainSettings:
    model = ModelConfig(context_length=16, d_model=32, n_layers=2, n_heads=2, d_ff=64,
                        norm="torch")
    fields = dict(model=model, data=str(data), steps=4, batch_size=8, lr=1e-2, min_lr=1e-3,
                  warmup=2, eval_every=0, eval_batches=1, out=str(out), sample_tokens=0,
                  quiet=True, plot=False, ddp="none", sharding="none", seed=0,
                  ckpt_every=2, keep_last=0, log_every=1)
    fields.update(overrides)
    return TrainSettings(**fields)


def losses(out) -> dict[int, float]:
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def test_a_background_save_overlaps_steps_and_writes_what_a_foreground_one_does(
        corpus_dir, tmp_path, monkeypatch):
    Trainer(settings(corpus_dir, tmp_path / "sync", ckpt_async=False), DistContext()).run()
    # The background write of step 2 is held until step 3 has trained.
    gate = threading.Event()
    real_crc = checkpoint_writer.file_crc

    def held_crc(path):
        assert gate.wait(60)
        return real_crc(path)

    monkeypatch.setattr(checkpoint_writer, "file_crc", held_crc)
    trainer = Trainer(settings(corpus_dir, tmp_path / "async"), DistContext())
    in_flight = []  # after each step: was a save being written?
    real_step = train_module.train_step

    def step(*args, **kwargs):
        out = real_step(*args, **kwargs)
        in_flight.append(trainer.checkpointer.in_flight)
        if len(in_flight) == 3:
            gate.set()
        return out

    monkeypatch.setattr(train_module, "train_step", step)
    trainer.run()
    assert in_flight[2], in_flight  # step 3 trained while step 2 was being written
    assert losses(tmp_path / "async") == losses(tmp_path / "sync")
    for step_name in ("step-000002", "step-000004"):
        a, b = tmp_path / "sync" / "ckpt" / step_name, tmp_path / "async" / "ckpt" / step_name
        shards = sorted(p.name for p in a.glob("*.distcp"))
        assert shards == sorted(p.name for p in b.glob("*.distcp")) == ["__0_0.distcp"]
        assert all((a / n).read_bytes() == (b / n).read_bytes() for n in shards)
        assert saved_tensors(a) == saved_tensors(b)
        small_a, small_b = load_trainer_state(a), load_trainer_state(b)
        for small in (small_a, small_b):  # all but the two settings that differ
            small.pop("checksums")
            small["settings"].pop("ckpt_async")
            small["settings"].pop("out")
        assert small_a.keys() == small_b.keys()
        assert [k for k in small_a if str(small_a[k]) != str(small_b[k])] == []


_KILLED_RUN = """
import json, sys, time
from pathlib import Path
from lab2_trainer.checkpoint import writer as checkpoint_writer
from lab2_trainer.training import loop as train_module
from lab2_trainer.config import TrainSettings
from lab2_trainer.runtime.launch import DistContext
from lab2_trainer.training.loop import Trainer

fields = json.loads(sys.argv[1])
real_crc = checkpoint_writer.file_crc

def crc(path):
    if "step-000004" in str(path):  # the second save: DCP has written, no manifest yet
        Path(sys.argv[2]).touch()
        time.sleep(3600)
    return real_crc(path)

checkpoint_writer.file_crc = crc
Trainer(TrainSettings.from_dict(fields), DistContext()).run()
"""


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="POSIX signals")
def test_kill_9_during_a_background_write_leaves_the_previous_checkpoint(corpus_dir, tmp_path):
    out = tmp_path / "run"
    s = settings(corpus_dir, out, steps=8)
    marker = tmp_path / "writing"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_RUN, json.dumps(s.to_dict()),
                             str(marker)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        # Step 4's write is held; training goes on to step 6, whose save waits for it.
        wait_for(lambda: marker.exists() and max(losses(out), default=0) >= 6, 180,
                 "the held write and step 6", proc)
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    before = losses(out)
    held = out / "ckpt" / "step-000004"
    assert any(held.glob("*.distcp")) and not (held / MANIFEST).exists()
    assert resolve(out) == out / "ckpt" / "step-000002"
    # The launcher resumes from step 2 and trains on, with the same losses bit for bit.
    assert main(["--resume", str(out), "--nproc", "1"]) == 0
    after = losses(out)
    assert sorted(after) == list(range(1, 9))
    assert all(after[s] == before[s] for s in before), (before, after)
    # The interrupted folder was rewritten; step 8 is the newest.
    assert resolve(out) == out / "ckpt" / "step-000008"
    assert (held / MANIFEST).is_file()


def test_a_large_part_is_written_by_several_threads_and_resumes_bit_for_bit(
        corpus_dir, tmp_path, monkeypatch):
    """One writer thread and file per BYTES_PER_THREAD of a rank's part, up to
    ``--ckpt-threads``: every file is in the manifest, and the checkpoint resumes."""
    monkeypatch.setattr(checkpoint_writer, "BYTES_PER_THREAD", 1 << 10)
    out = tmp_path / "run"
    Trainer(settings(corpus_dir, out, steps=4, ckpt_threads=3), DistContext()).run()
    step2 = out / "ckpt" / "step-000002"
    shards = sorted(p.name for p in step2.glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__0_1.distcp", "__0_2.distcp"]
    listed = json.loads((step2 / MANIFEST).read_text())["files"]
    assert set(shards) | {".metadata", "trainer.pt"} == set(listed)
    assert all(listed[n]["bytes"] == (step2 / n).stat().st_size for n in listed)
    resumed = tmp_path / "resumed"
    Trainer(settings(corpus_dir, resumed, steps=4, resume=str(step2)), DistContext()).run()
    assert losses(resumed) == {s: v for s, v in losses(out).items() if s > 2}


def test_small_parts_stay_one_file_and_a_cpu_run_makes_no_pinned_buffers(corpus_dir,
                                                                         tmp_path):
    trainer = Trainer(settings(corpus_dir, tmp_path / "run", ckpt_threads=8), DistContext())
    trainer.run()
    assert [p.name for p in (tmp_path / "run" / "ckpt" / "step-000004").glob("*.distcp")] == [
        "__0_0.distcp"]
    trainer.checkpointer.make_buffers(10.0)
    assert trainer.checkpointer._pending is None


def test_pinned_buffers_are_made_a_slice_at_a_time(corpus_dir, tmp_path, monkeypatch):
    """On CUDA each call makes buffers for about its budget and returns; together they make
    one buffer per tensor part the save copies (the allocation is stood in for here: each
    takes 10 ms, pinning asked for)."""
    trainer = Trainer(settings(corpus_dir, tmp_path / "run"), DistContext())
    writer = checkpoint_writer.Checkpointer(tmp_path / "out", trainer.model, trainer.optimizer,
                                            "none", torch.device("cuda"))
    real_empty = torch.empty
    made = []

    def slow_pinned(shape, **kw):
        if not kw.pop("pin_memory", False):  # not a buffer: the shapes of the parts
            return real_empty(shape, **kw)
        time.sleep(0.01)
        made.append(shape)
        return real_empty(shape, **kw)

    monkeypatch.setattr(checkpoint_writer.torch, "empty", slow_pinned)
    writer.make_buffers(0.025)
    first = len(made)
    assert 1 <= first <= 4 and writer._pending
    while writer._pending:
        writer.make_buffers(0.025)
    expected = writer._expected()
    assert sorted(writer._buffers) == sorted(key for key, _, _ in expected)
    assert len(made) == len(expected) > first
    writer.make_buffers(0.025)  # all made: nothing more
    assert len(made) == len(expected)


def test_keep_last_and_the_newest_complete_step(corpus_dir, tmp_path):
    out = tmp_path / "run"
    Trainer(settings(corpus_dir, out, steps=5, ckpt_every=1, keep_last=2),
            DistContext()).run()
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == ["step-000004", "step-000005"]
    (out / "ckpt" / "step-000009").mkdir()  # an interrupted write: no manifest
    assert resolve(out) == resolve(out / "ckpt") == out / "ckpt" / "step-000005"
    assert newest_step(out / "ckpt") == out / "ckpt" / "step-000005"
    assert resolve(out / "ckpt" / "step-000004") == out / "ckpt" / "step-000004"


def test_export_loads_into_a_plain_model_and_adamw_and_resumes(corpus_dir, tmp_path):
    s = settings(corpus_dir, tmp_path / "run", steps=6)
    s.model = dataclasses.replace(s.model, tie_embeddings=True)  # one tensor, two names
    trainer = Trainer(s, DistContext())
    trainer.run(stop_at=3)
    target = tmp_path / "export.pt"
    assert main(["export", str(tmp_path / "run"), str(target)]) == 0
    ckpt = torch.load(target, weights_only=True)
    model = TransformerLM(s.model)
    model.load_state_dict(ckpt["model"])
    assert bitwise_equal(model.state_dict(), trainer.model.state_dict())
    adamw = torch.optim.AdamW(param_groups(model, s.weight_decay), lr=s.lr)
    adamw.load_state_dict(ckpt["optimizer"])
    ours = [trainer.optimizer.state[p] for g in trainer.optimizer.param_groups
            for p in g["params"]]
    theirs = [adamw.state[p] for g in adamw.param_groups for p in g["params"]]
    assert len(ours) == len(theirs) == len(list(model.parameters()))
    for a, b in zip(ours, theirs):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    # --resume takes the export as it takes the folder: the same run on, bit for bit.
    resumed = {}
    for name, source in (("a", tmp_path / "run"), ("b", target)):
        r = settings(corpus_dir, tmp_path / name, steps=6, resume=str(source))
        r.model = s.model
        resumed[name] = Trainer(r, DistContext())
    from_folder, from_file = resumed["a"], resumed["b"]
    from_folder.run()
    from_file.run()
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    assert bitwise_equal(from_folder.model.state_dict(), from_file.model.state_dict())
    assert export(tmp_path / "a", tmp_path / "a.pt") == tmp_path / "a" / "ckpt" / "step-000006"


def test_a_failed_background_write_is_one_line_and_training_goes_on(corpus_dir, tmp_path,
                                                                    disk_full_at, capsys):
    disk_full_at(2)
    trainer = Trainer(settings(corpus_dir, tmp_path / "run"), DistContext())
    trainer.run()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["lab2-train: warning: rank 0: checkpoint of step 2 was not written "
                   "(OSError: No space left on device); the previous one is intact"], err
    assert sorted(losses(tmp_path / "run")) == [1, 2, 3, 4]
    assert resolve(tmp_path / "run") == tmp_path / "run" / "ckpt" / "step-000004"
