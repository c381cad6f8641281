"""``lab2bench.timing.paired_windows``: windows in balanced order, ratios paired per round."""

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
    # Every window is one untimed call and 3 timed; round 2 is round 1 reversed.
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


def test_order_is_balanced_around_the_baseline(monkeypatch):
    """Over each pair of rounds every variant runs once before the baseline and once
    after it, at the same distance."""
    order = []
    fns = {name: (lambda name=name: order.append(name)) for name in ("t", "a", "b")}
    timing.paired_windows(fns, rounds=6, window=1, warmup=0)
    rounds = [order[i:i + 6:2] for i in range(0, 36, 6)]  # each window: untimed + timed call
    assert rounds == [["t", "a", "b"], ["b", "a", "t"], ["a", "b", "t"], ["t", "b", "a"],
                      ["b", "t", "a"], ["a", "t", "b"]]
    for name in ("a", "b"):
        offsets = [r.index(name) - r.index("t") for r in rounds]
        assert offsets[1::2] == [-o for o in offsets[0::2]]
