"""measure() and Stats on a fake clock: exact figures, warm-up left out, backward mode."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lab2bench
from lab2bench import Stats, measure
from lab2bench.timing import graph_time


class FakeClock:
    """Each call to fn advances time by the next duration; reading the clock is free."""

    def __init__(self, durations: list[float]) -> None:
        self.now = 0.0
        self.durations = list(durations)
        self.calls = 0

    def __call__(self) -> float:
        return self.now

    def work(self) -> None:
        self.calls += 1
        self.now += self.durations.pop(0)


def test_stats_exact_on_fake_clock():
    warm = [100.0, 200.0]  # huge, so any leak into the figures shows
    timed = [0.004, 0.001, 0.003, 0.002, 0.010]
    clock = FakeClock(warm + timed)
    stats = measure(clock.work, warmup=2, repeats=5, clock=clock)
    assert clock.calls == 7
    assert stats.samples == pytest.approx(timed, abs=1e-12)
    assert stats.mean == pytest.approx(statistics.fmean(timed))
    assert stats.std == pytest.approx(statistics.stdev(timed))
    assert stats.median == pytest.approx(0.003)
    assert stats.min == pytest.approx(0.001)
    assert stats.max == pytest.approx(0.010)
    assert stats.n == 5
    assert stats.median_ms == pytest.approx(3.0)
    assert stats.max_ms == pytest.approx(10.0)


@pytest.mark.parametrize("warmup,repeats", [(0, 1), (3, 4), (5, 2)])
def test_warmup_calls_excluded(warmup, repeats):
    clock = FakeClock([7.0] * warmup + [1.0] * repeats)
    stats = measure(clock.work, warmup=warmup, repeats=repeats, clock=clock)
    assert clock.calls == warmup + repeats
    assert stats.samples == [1.0] * repeats
    assert stats.std == 0.0


def test_stats_to_dict_and_single_sample():
    s = Stats.from_samples([0.5])
    assert (s.mean, s.std, s.median, s.min, s.max) == (0.5, 0.0, 0.5, 0.5, 0.5)
    d = Stats.from_samples([0.001, 0.003]).to_dict(unit="ms")
    assert d["mean_ms"] == pytest.approx(2.0)
    assert d["samples_ms"] == pytest.approx([1.0, 3.0])
    assert d["n"] == 2
    assert "samples_s" not in Stats.from_samples([1.0]).to_dict(samples=False)
    with pytest.raises(ValueError, match="at least one"):
        Stats.from_samples([])
    with pytest.raises(ValueError, match="unit"):
        s.to_dict(unit="h")


def test_backward_mode_calls_backward_in_timed_region():
    torch.manual_seed(0)
    x = torch.randn(4, 3, requires_grad=True)
    clock = FakeClock([0.0] * 100)
    events = []

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            events.append("forward")
            return t * 2

        @staticmethod
        def backward(ctx, g):
            events.append("backward")
            clock.now += 0.5  # backward takes 0.5 s of fake time
            return g * 2

    def fn():
        clock.now += 0.25
        x.grad = None
        return Spy.apply(x)

    stats = measure(fn, warmup=1, repeats=3, backward=True, clock=clock)
    assert events == ["forward", "backward"] * 4
    assert stats.samples == pytest.approx([0.75] * 3)  # forward + backward both timed
    assert torch.equal(x.grad, torch.full_like(x, 2.0))  # default gradient: ones


def test_backward_with_explicit_grad_and_tuple_output():
    x = torch.randn(5, requires_grad=True)
    g = torch.arange(5, dtype=torch.float32)

    def fn():
        x.grad = None
        return (x * 3, "extra")

    measure(fn, warmup=0, repeats=2, backward=True, grad=g, device="cpu")
    assert torch.equal(x.grad, 3 * g)
    assert torch.equal(g, torch.arange(5, dtype=torch.float32))  # never written into


def test_backward_never_writes_into_the_given_gradient():
    class WritesIntoGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 1

        @staticmethod
        def backward(ctx, g):
            g.mul_(5)  # like a kernel that reuses grad_output's memory for dx
            return g

    x = torch.randn(3, requires_grad=True)
    g = torch.full((3,), 2.0)
    for _ in range(2):
        x.grad = None
        measure(lambda: WritesIntoGrad.apply(x), warmup=2, repeats=3, backward=True, grad=g,
                device="cpu")
        assert torch.equal(g, torch.full((3,), 2.0))
        assert torch.equal(x.grad, torch.full((3,), 10.0 * 5))  # 5 calls, each 2 * 5


def test_backward_with_no_warmup_uses_one_untimed_call():
    calls = []
    x = torch.randn(3, requires_grad=True)

    def fn():
        calls.append(1)
        return x.sum()

    stats = measure(fn, warmup=0, repeats=2, backward=True, device="cpu")
    assert len(calls) == 3 and stats.n == 2


def test_real_cpu_timer_measures_something():
    a = torch.randn(64, 64)
    stats = measure(lambda: a @ a, warmup=1, repeats=3, device="cpu", flush_l2=True)
    assert stats.n == 3 and stats.min > 0 and stats.min <= stats.median <= stats.max


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"repeats": 0}, ValueError, "repeats"),
        ({"warmup": -1}, ValueError, "warmup"),
        ({"grad": torch.ones(1)}, ValueError, "backward=True"),
        ({"device": "not-a-device"}, ValueError, "not a device"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        measure(lambda: None, **kwargs)


def test_backward_errors_are_clear():
    with pytest.raises(TypeError, match="return a tensor"):
        measure(lambda: 3, warmup=0, repeats=1, backward=True, device="cpu")
    with pytest.raises(ValueError, match="requires_grad"):
        measure(lambda: torch.ones(2), warmup=0, repeats=1, backward=True, device="cpu")
    with pytest.raises(TypeError, match="callable"):
        measure(42)


def test_copy_bandwidth_positive():
    bw = lab2bench.copy_bandwidth("cpu", nbytes=1 << 20, warmup=1, repeats=3)
    assert bw > 0


@given(st.lists(st.floats(min_value=1e-9, max_value=1e3, allow_nan=False), min_size=1,
                max_size=40))
def test_stats_properties(samples):
    s = Stats.from_samples(samples)
    assert s.min <= s.median <= s.max
    assert s.min * (1 - 1e-12) <= s.mean <= s.max * (1 + 1e-12)
    assert s.std >= 0
    ref_std = float(np.std(samples, ddof=1)) if len(samples) > 1 else 0.0
    assert s.std == pytest.approx(ref_std, rel=1e-9, abs=1e-12)
    assert s.median == pytest.approx(float(np.median(samples)))
    assert s.samples == samples


def test_cuda_device_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        measure(lambda: None, device="cuda")


def test_graph_time_needs_cuda_and_takes_no_clock():
    with pytest.raises(ValueError, match="graph_time needs a CUDA device"):
        graph_time(lambda: None, device="cpu")
    clock = FakeClock([0.0] * 10)
    with pytest.raises(TypeError, match="clock"):
        graph_time(clock.work, clock=clock)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replays_forward_and_backward():
    torch.manual_seed(0)
    x = torch.randn(256, 512, device="cuda", requires_grad=True)
    w = torch.rand(512, device="cuda") + 0.5

    def step():
        x.grad = None
        return (x * w).sin()

    stats = graph_time(step, warmup=2, repeats=5, backward=True, flush_l2=True)
    assert stats.n == 5 and stats.min > 0
    # The replays wrote the gradient of the captured call into x.grad.
    torch.testing.assert_close(x.grad, (x * w).cos().detach() * w)
