"""Where a run's wall clock goes: the phases add up to the wall clock, goodput is in (0, 1],
checkpoint stalls are counted once and only on the training thread, and a tiny run's
summary and metrics carry the split."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
import torch._dynamo

from lab2_trainer.config import ModelConfig, TrainSettings
from lab2_trainer.runtime import wall_clock
from lab2_trainer.runtime.launch import DistContext
from lab2_trainer.runtime.wall_clock import PHASES, WallClock, checkpoint_stall
from lab2_trainer.training.loop import Trainer

torch.set_num_threads(1)


def tiny_settings(data: Path, out: Path, **overrides) -> TrainSettings:
    model = ModelConfig(context_length=16, d_model=16, n_layers=2, n_heads=2, d_ff=32)
    fields = dict(model=model, data=str(data), steps=6, batch_size=4, lr=1e-2, min_lr=1e-3,
                  warmup=2, eval_every=3, eval_batches=1, out=str(out), sample_tokens=8,
                  quiet=True, plot=False, ddp="none", sharding="none", seed=0, log_every=2,
                  ckpt_every=3)
    fields.update(overrides)
    return TrainSettings(**fields).validate(1)


def assert_adds_up(split: dict, wall: float | None = None) -> None:
    assert set(split) == {"wall_s", "goodput", "startup_parts", *(f"{p}_s" for p in PHASES)}
    parts = [split[f"{p}_s"] for p in PHASES]
    startup = split["startup_parts"]
    assert next(iter(startup)) == "launch" and all(v >= 0 for v in startup.values())
    if split["training_s"] > 0:  # start-up is over: its parts add up to it
        assert sum(startup.values()) == pytest.approx(split["startup_s"], rel=1e-9, abs=1e-9)
    assert all(part >= 0 for part in parts), split
    assert sum(parts) == pytest.approx(split["wall_s"], rel=1e-9, abs=1e-9)
    assert 0 < split["goodput"] <= 1
    assert split["goodput"] == pytest.approx(split["training_s"] / split["wall_s"])
    if wall is not None:
        assert split["wall_s"] == pytest.approx(wall, abs=0.25), split


def test_phases_add_up_and_compilation_is_carved_out_of_training():
    clock = WallClock(start=time.time() - 2.0)  # launched two seconds ago
    clock.switch("training")
    time.sleep(0.05)
    with clock.phase("evaluation"):
        time.sleep(0.02)
    assert clock.current == "training"
    split = clock.split(first_step_s=0.03, steady_step_s=0.01)
    assert split["startup_s"] == pytest.approx(2.0, abs=0.05)
    assert split["evaluation_s"] >= 0.02
    assert split["compilation_s"] == pytest.approx(0.02)
    assert split["training_s"] >= 0.05 - 0.02
    assert_adds_up(split)
    # No steady step yet: nothing is carved out.
    assert clock.split(first_step_s=0.03)["compilation_s"] == 0.0


def test_compilation_inside_evaluation_is_carved_out_of_it(monkeypatch):
    compiled = [10.0]  # dynamo's running total
    monkeypatch.setattr(wall_clock, "dynamo_compile_seconds", lambda: compiled[0])
    clock = WallClock()
    clock.switch("training")
    with clock.phase("evaluation", carve_compilation=True):
        time.sleep(0.05)
        compiled[0] += 0.03  # dynamo compiled for 30 ms of it
    with clock.phase("evaluation", carve_compilation=True):  # compiled nothing more
        time.sleep(0.01)
    split = clock.split()
    assert split["compilation_s"] == pytest.approx(0.03)
    assert split["evaluation_s"] >= 0.05 + 0.01 - 0.03
    assert_adds_up(split)


def test_dynamo_compile_seconds_counts_a_compiled_frame():
    torch._dynamo.reset()
    before = wall_clock.dynamo_compile_seconds()
    torch.compile(lambda x: x * 2, backend="eager")(torch.ones(2))
    assert wall_clock.dynamo_compile_seconds() > before


def test_bad_phase_is_refused():
    with pytest.raises(ValueError, match="compilation is carved out"):
        WallClock().switch("compilation")
    with pytest.raises(ValueError, match="phase must be one of"):
        WallClock().switch("lunch")


def test_checkpoint_stall_counts_once_on_the_training_thread_only():
    clock = WallClock()
    clock.switch("training")
    with checkpoint_stall():  # no running clock: nothing counted, nothing raised
        pass
    with clock.active():
        with checkpoint_stall():
            with checkpoint_stall():  # nested: counted once
                time.sleep(0.03)
            assert clock.current == "checkpoint"
        assert clock.current == "training"

        def writer():  # a background writer's stall is not the loop's
            with checkpoint_stall():
                time.sleep(0.03)

        thread = threading.Thread(target=writer)
        thread.start()
        thread.join()
    assert wall_clock._active is None
    split = clock.split()
    assert 0.03 <= split["checkpoint_s"] < 0.06, split


def test_a_run_reports_where_its_wall_clock_went(corpus_dir, tmp_path, monkeypatch):
    # A slow checkpoint write: the stall must show as checkpoint time, not training.
    save = Trainer.save_checkpoint

    def slow_save(self, *args, **kwargs):
        time.sleep(0.2)
        save(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "save_checkpoint", slow_save)
    wall_clock.mark_launch()
    began = time.time()
    summary = Trainer(tiny_settings(corpus_dir, tmp_path / "run"), DistContext()).run()
    split = summary["wall_clock"]
    assert_adds_up(split, wall=time.time() - began)
    assert split["checkpoint_s"] >= 2 * 0.2  # saves at steps 3 and 6
    for phase in ("startup", "training", "evaluation", "sampling"):
        assert split[f"{phase}_s"] > 0, phase
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["wall_clock"]["goodput"] == pytest.approx(split["goodput"], rel=0.05)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    # The first step is fetched alone (it holds the compilation), then every log step.
    logged = [r["step"] for r in records if "wall_clock" in r]
    assert logged == [1, 2, 3, 4, 6]
    for record in records:
        if "wall_clock" in record:
            assert_adds_up(record["wall_clock"])
    # Compilation is the first step less a steady one (the mean of the steps after it).
    steady = sum(r["step_seconds"] for r in records[1:]) / len(records[1:])
    assert split["compilation_s"] == pytest.approx(
        max(0.0, records[0]["step_seconds"] - steady), rel=1e-2, abs=1e-3)


def test_start_up_is_split_by_mark_and_ends_at_the_first_switch():
    clock = WallClock(start=time.time() - 1.0)  # launched a second ago
    time.sleep(0.02)
    clock.mark("model")
    time.sleep(0.03)
    clock.mark("data")
    clock.mark("data")  # a part marked twice adds up
    time.sleep(0.01)
    clock.switch("training")
    clock.mark("late")  # start-up is over: not a part
    split = clock.split()
    parts = split["startup_parts"]
    assert list(parts) == ["launch", "model", "data", "rest"]
    assert parts["launch"] == pytest.approx(1.0, abs=0.1)
    assert parts["model"] >= 0.02 and parts["data"] >= 0.03 and parts["rest"] >= 0.01
    assert sum(parts.values()) == pytest.approx(split["startup_s"], rel=1e-9)


def test_the_launch_is_split_by_its_marks_before_the_clock(monkeypatch):
    monkeypatch.setattr(wall_clock, "_launch_marks", [])
    wall_clock.mark_launch()
    time.sleep(0.03)
    wall_clock.mark_launch("imports")
    time.sleep(0.02)
    wall_clock.mark_launch("device")
    time.sleep(0.01)
    clock = WallClock(wall_clock.launch_start())
    clock.switch("training")
    split = clock.split()
    parts = split["startup_parts"]
    assert list(parts) == ["launch", "imports", "device", "rest"]
    assert parts["imports"] >= 0.03 and parts["device"] >= 0.02 and parts["launch"] >= 0.01
    assert sum(parts.values()) == pytest.approx(split["startup_s"], abs=1e-3)
    # The marks are used once: a later clock in the same process does not count them again.
    assert list(WallClock(time.time()).split()["startup_parts"]) == ["launch"]


def test_a_run_names_the_parts_of_its_start_up(corpus_dir, tmp_path):
    Trainer(tiny_settings(corpus_dir, tmp_path / "run"), DistContext()).run()
    split = json.loads((tmp_path / "run" / "summary.json").read_text())["wall_clock"]
    assert {"launch", "data", "model", "parallelize", "checkpoint writer", "batches",
            "rest"} <= set(split["startup_parts"])
    assert sum(split["startup_parts"].values()) == pytest.approx(split["startup_s"])
