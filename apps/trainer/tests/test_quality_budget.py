"""``benchmarks/quality.py``: the arithmetic that sizes a ``--budget`` run from its probe's
records, and the wall clock and tokens to ``--target``, on synthetic metrics."""

from __future__ import annotations

import importlib
import json
import random
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def quality(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("quality")


def probe_records(windows: list[tuple[int, float]]) -> list[dict]:
    """metrics.jsonl records of a probe fetched in ``windows`` of (steps, seconds a step):
    every step of a window has the window's mean."""
    records, step = [], 0
    for steps, seconds in windows:
        for _ in range(steps):
            step += 1
            records.append({"step": step, "loss": 3.0, "step_seconds": seconds,
                            "tokens": step * 4096})
    return records


def probe_summary(records: list[dict], fixed: float, evaluation: float) -> dict:
    steps = sum(r["step_seconds"] for r in records)
    return {"steps": len(records), "wall_clock": {
        "wall_s": fixed + steps + evaluation, "evaluation_s": evaluation}}


def test_the_budget_is_sized_from_steady_steps_and_the_fixed_rest(quality):
    # A compiled probe: its first step compiles (20 s), the next ones still warm up (pinned
    # buffers made a slice per step), then 0.1 s steps.
    windows = [(1, 20.0), (4, 0.4), (5, 0.15)] + [(5, 0.1)] * 6
    records = probe_records(windows)
    assert records[-1]["step"] == quality.PROBE_STEPS
    startup, checkpoint, eval_s = 9.0, 2.0, 0.2
    summary = probe_summary(records, startup + checkpoint, eval_s)
    steps, figures = quality.size_run(records, summary, budget=120.0, eval_batches=32)
    assert figures["probe_step_s"] == pytest.approx(0.1)
    # Fixed: everything but 40 steady steps and the evaluation (start-up, checkpoint, and
    # what the first steps cost beyond steady ones).
    warm_extra = (20.0 - 0.1) + 4 * (0.4 - 0.1) + 5 * (0.15 - 0.1)
    assert figures["probe_fixed_s"] == pytest.approx(startup + checkpoint + warm_extra)
    eval_batch = eval_s / quality.PROBE_EVAL_BATCHES
    assert figures["probe_eval_batch_s"] == pytest.approx(eval_batch)

    def wall(n: int) -> float:  # a run of n steps: the probe's fixed part, steps, evaluations
        return figures["probe_fixed_s"] + n * 0.1 + quality.eval_count(n) * 32 * eval_batch

    assert figures["planned_eval_s"] == pytest.approx(quality.eval_count(steps) * 32 * eval_batch)
    assert figures["planned_wall_s"] == pytest.approx(wall(steps))
    # The most steps within the budget: it fills it to within a step and an evaluation.
    assert wall(steps) <= 120 < wall(steps + 1) + 32 * eval_batch
    assert wall(steps) >= 120 - 0.1 - 32 * eval_batch
    # The probe's mean step after the first, as the sizing took it before, would have
    # been a third too slow here: a run 30% short.
    mean_after_first = sum(r["step_seconds"] for r in records[1:]) / (len(records) - 1)
    assert mean_after_first > 1.25 * figures["probe_step_s"]


@pytest.mark.parametrize("seed", range(5))
def test_a_noisy_probe_still_fills_the_budget(quality, seed):
    rng = random.Random(seed)
    step = rng.uniform(0.02, 0.5)
    windows = [(1, rng.uniform(5, 60)), (4, step * rng.uniform(1.5, 4))] + [
        (5, step * rng.uniform(0.97, 1.03)) for _ in range(7)]
    records = probe_records(windows)
    fixed, eval_s = rng.uniform(5, 30), rng.uniform(0.05, 2)
    budget = rng.uniform(120, 900)
    steps, figures = quality.size_run(records, probe_summary(records, fixed, eval_s), budget, 32)
    # The run: the same fixed part and first steps, then steady steps, then its evaluations.
    run_wall = (fixed + sum(r["step_seconds"] for r in records[:15])
                + (steps - 15) * step + quality.eval_count(steps) * 32 * eval_s
                / quality.PROBE_EVAL_BATCHES)
    assert 0.9 * budget <= run_wall <= 1.1 * budget, (run_wall, budget)


def test_the_evaluations_a_run_makes(quality):
    assert [quality.eval_count(n) for n in (1, 19, 20, 40, 57, 400, 410)] == [
        1, 19, 20, 20, 29, 20, 21]


def test_a_budget_below_the_fixed_part_gets_the_probes_steps(quality):
    records = probe_records([(1, 30.0)] + [(5, 0.1)] * 7 + [(4, 0.1)])
    steps, _ = quality.size_run(records, probe_summary(records, 50.0, 0.1), 20.0, 32)
    assert steps == quality.PROBE_STEPS


def test_a_probe_without_steady_steps_is_refused(quality):
    with pytest.raises(ValueError, match="no step after its first"):
        quality.steady_step_seconds(probe_records([(1, 3.0)]))


def write_metrics(path: Path, vals: dict[int, float], steps: int = 100) -> None:
    """A run's metrics.jsonl: one record a step, 2 s a step from 10 s, an evaluation at
    each step of ``vals``."""
    with open(path, "w") as f:
        for step in range(1, steps + 1):
            record = {"step": step, "loss": 2.0 - step / 100, "tokens": step * 16384,
                      "step_seconds": 2.0}
            if step in vals:
                record.update(val_loss=vals[step], val_ppl=2.0,
                              wall_clock={"wall_s": 10.0 + 2.0 * step})
            f.write(json.dumps(record) + "\n")


def test_time_to_target_from_the_metrics(quality, tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_metrics(path, {25: 1.2, 50: 0.9, 75: 0.85, 100: 0.80})
    rows = quality.evaluations(quality.read_records(path))
    assert [r["tokens"] for r in rows] == [25 * 16384, 50 * 16384, 75 * 16384, 100 * 16384]
    hit = quality.time_to_target(rows, 0.85)
    assert hit == {"target": 0.85, "target_s": 160.0, "target_tokens": 75 * 16384,
                   "target_step": 75}
    assert quality.target_text(hit) == "reached 0.85 at 160 s (1,228,800 tokens)"
    missed = quality.time_to_target(rows, 0.5)
    assert missed["target_s"] is None and missed["target_tokens"] is None
    assert quality.target_text(missed) == "not reached"
    # In the report, its JSON and its table.
    summary = {"compression": {"gzip": 1.4, "xz": 1.18}, "steps": 100,
               "tokens": 100 * 16384, "wall_clock": {"wall_s": 215.0}}
    result = quality.report(rows, summary, 0.85)
    assert (result["target"], result["target_s"], result["target_tokens"]) == (
        0.85, 160.0, 75 * 16384)
    json.dumps(result)
    text = quality.markdown({**result, "command": ["lab2-train"], "budget_s": 240.0}, rows)
    assert "| target 0.85 | reached 0.85 at 160 s (1,228,800 tokens) |" in text
    assert "Budget 240 s: the run took 215 s (90%)." in text
    assert "| target 0.5 | not reached |" in quality.markdown(
        {**quality.report(rows, summary, 0.5), "command": ["x"]}, rows)


def test_probe_and_run_commands(quality):
    import argparse

    args = argparse.Namespace(preset="small", device="cuda", eval_batches=32, extra=["--x"])
    probe = quality.command(args, Path("p"), quality.PROBE_STEPS, probe=True)
    assert probe[probe.index("--log-every") + 1] == str(quality.PROBE_LOG_EVERY)
    assert probe[probe.index("--eval-batches") + 1] == str(quality.PROBE_EVAL_BATCHES)
    assert "--no-plot" not in probe and probe[-1] == "--x"  # the run plots: so does the probe
    run = quality.command(args, Path("r"), 400)
    # The trainer's defaults: precision and compilation left to the device.
    assert "--precision" not in run and "--compile" not in run
    assert run[run.index("--eval-every") + 1] == "20"
