"""``lab2bench.timing.paired_windows``: windows in rotated order, ratios paired per round."""

from __future__ import annotations

import pytest

from lab2bench import timing


def test_ratios_are_paired_round_by_round(monkeypatch):
    """A fake clock: each call of a variant costs its own time, which grows as the run goes
    on (a machine that slows down); the ratio is the median of the rounds' own ratios."""
    clock = {"now": 0.0, "calls": []}
    monkeypatch.setattr(timing.timeit, "default_timer", lambda: clock["now"])

    def variant(name: str, cost: float):
        def call() -> None:
            clock["calls"].append(name)
            clock["now"] += cost * (1 + len(clock["calls"]) / 8)
        return call

    out = timing.paired_windows({"base": variant("base", 1.0), "fast": variant("fast", 0.5)},
                                rounds=4, window=3, warmup=2)
    assert clock["calls"][:4] == ["base", "base", "fast", "fast"]  # warm-up of each
    # Every window is one untimed call and 3 timed; round 2 starts with "fast".
    assert clock["calls"][4:12] == ["base"] * 4 + ["fast"] * 4
    assert clock["calls"][12:20] == ["fast"] * 4 + ["base"] * 4
    assert len(out["base"]["times_ms"]) == len(out["fast"]["times_ms"]) == 4
    assert out["base"]["ratio"] == pytest.approx(1.0) and out["base"]["diff_ms"] == 0
    assert out["fast"]["ratio"] == pytest.approx(2.0, rel=0.2)
    assert out["fast"]["median_ms"] < out["base"]["median_ms"]
    assert out["fast"]["ratio_q1"] <= out["fast"]["ratio"] <= out["fast"]["ratio_q3"]


def test_real_calls_and_bad_arguments():
    out = timing.paired_windows({"a": lambda: sum(range(100))}, rounds=1, window=2)
    assert out["a"]["ratio"] == 1.0 and out["a"]["min_ms"] > 0
    with pytest.raises(ValueError):
        timing.paired_windows({"a": lambda: None}, rounds=0, window=1)
    with pytest.raises(ValueError):
        timing.paired_windows({}, rounds=1, window=1)
