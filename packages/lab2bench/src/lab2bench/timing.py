"""Timing a callable correctly: warm-up, synchronisation, L2 flush, statistics; eager
(``measure``) or as replays of a CUDA graph (``graph_time``).

GPU kernels run asynchronously: the Python call returns as soon as the work is
queued. ``measure`` therefore records CUDA events around each call and waits for
the device before reading them; on the CPU it reads ``timeit.default_timer``.
The first calls compile kernels, fill caches and grow the allocator, so a few
warm-up calls run first and are left out of the figures.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import timeit
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lab2bench.devices import resolve_device, synchronize

#: Bytes written between timed calls to evict the GPU's L2 cache. An H100/H200 has
#: 50-60 MB of L2; 256 MiB is several times that, so nothing of the previous call's
#: data is left in it.
CUDA_FLUSH_BYTES = 256 * 1024 * 1024
#: On the CPU the buffer only needs to outgrow a core's L2 (and most of the LLC).
CPU_FLUSH_BYTES = 64 * 1024 * 1024

_flush_buffers: dict[torch.device, torch.Tensor] = {}


@dataclass(frozen=True)
class Stats:
    """Summary of the timed samples of one measurement, all in seconds.

    ``std`` is the sample standard deviation (n - 1 in the denominator), 0 for a
    single sample. ``samples`` keeps every timed call in order.
    """

    mean: float
    std: float
    median: float
    min: float
    max: float
    samples: list[float] = field(default_factory=list)

    @classmethod
    def from_samples(cls, samples: Sequence[float]) -> Stats:
        """Summarise a non-empty sequence of durations in seconds."""
        values = [float(s) for s in samples]
        if not values:
            raise ValueError("Stats.from_samples needs at least one sample")
        if any(math.isnan(v) for v in values):
            raise ValueError(f"a sample is NaN: {values}")
        return cls(mean=statistics.fmean(values),
                   std=statistics.stdev(values) if len(values) > 1 else 0.0,
                   median=statistics.median(values), min=min(values), max=max(values),
                   samples=values)

    @property
    def n(self) -> int:
        """Number of timed samples."""
        return len(self.samples)

    mean_ms = property(lambda self: self.mean * 1e3)
    std_ms = property(lambda self: self.std * 1e3)
    median_ms = property(lambda self: self.median * 1e3)
    min_ms = property(lambda self: self.min * 1e3)
    max_ms = property(lambda self: self.max * 1e3)

    def to_dict(self, *, unit: str = "s", samples: bool = True) -> dict[str, Any]:
        """The statistics as a JSON-ready dict.

        Args:
            unit: ``"s"`` (keys ``mean_s``...) or ``"ms"`` (keys ``mean_ms``...).
            samples: include the list of samples (key ``samples_s`` or ``samples_ms``).
        """
        scale = {"s": 1.0, "ms": 1e3, "us": 1e6}.get(unit)
        if scale is None:
            raise ValueError(f"unit must be 's', 'ms' or 'us', got {unit!r}")
        out: dict[str, Any] = {
            f"{k}_{unit}": getattr(self, k) * scale for k in ("mean", "std", "median", "min", "max")
        }
        out["n"] = self.n
        if samples:
            out[f"samples_{unit}"] = [s * scale for s in self.samples]
        return out


def _flush_buffer(device: torch.device) -> torch.Tensor:
    buf = _flush_buffers.get(device)
    if buf is None:
        nbytes = CUDA_FLUSH_BYTES if device.type == "cuda" else CPU_FLUSH_BYTES
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            l2 = int(getattr(props, "L2_cache_size", 0) or 0)
            nbytes = max(nbytes, 4 * l2)
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        _flush_buffers[device] = buf
    return buf


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, (tuple, list)):
        if not out:
            raise ValueError("backward=True: fn returned an empty tuple/list")
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"backward=True needs fn to return a tensor, got {type(out).__name__}")
    if not out.requires_grad:
        raise ValueError(
            "backward=True: fn's output does not require grad; give the inputs requires_grad=True"
        )
    return out


def _warm_up(fn: Callable[[], Any], warmup: int, repeats: int, dev: torch.device,
             backward: bool, grad: torch.Tensor | None) -> torch.Tensor | None:
    """Check the arguments, run the untimed calls, and return the gradient template."""
    if not callable(fn):
        raise TypeError(f"fn must be callable with no arguments, got {type(fn).__name__}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    if grad is not None and not backward:
        raise ValueError("grad is only used with backward=True")
    for _ in range(warmup + (backward and grad is None and warmup == 0)):
        out = fn()
        if backward:
            y = _first_tensor(out)
            if grad is None:  # ones shaped like the output, from the first call
                grad = torch.ones_like(y)
            # A copy: some backward kernels (Liger's) write into grad_output in place.
            y.backward(grad.clone())
    synchronize(dev)
    return grad


def measure(fn: Callable[[], Any], *, warmup: int = 3, repeats: int = 10,
            device: torch.device | str | None = None, flush_l2: bool = False,
            backward: bool = False, grad: torch.Tensor | None = None,
            clock: Callable[[], float] | None = None) -> Stats:
    """Time ``fn()`` eagerly: ``warmup`` untimed calls, then ``repeats`` timed ones.

    On CUDA each timed call sits between two CUDA events; the calls are queued back to
    back and the device is synchronised once at the end, so each figure is the device
    time of one call's work (plus any gap the host leaves, where the host is slower).
    On the CPU (or with an injected ``clock``) wall time is read around the call.

    Args:
        fn: a callable taking no arguments (close over the inputs).
        warmup: untimed calls before the timed ones (compilation, caches, allocator).
        repeats: timed calls; at least 1.
        device: where ``fn`` runs: a ``torch.device``, a string, or None for CUDA when
            available, else the CPU.
        flush_l2: before each timed call, outside the timed region, overwrite a buffer
            several times larger than the L2 cache, so every call starts cold, as
            ``triton.testing.do_bench`` does.
        backward: time forward and backward: ``fn`` returns a tensor (or a tuple/list
            whose first item is used) that requires grad, and ``.backward(grad)`` runs
            inside the timed region. Gradients accumulate into the inputs' ``.grad``
            like in training; set them to None inside ``fn`` if the accumulation
            should not be timed.
        grad: the gradient passed to backward. Default: ones shaped like the output,
            taken from the first (warm-up) call; with ``warmup=0`` one extra untimed
            call makes it. A fresh copy is made for every call, outside the timed region.
        clock: a zero-argument timer returning seconds (tests inject a fake one). It
            forces the CPU path: no CUDA events and no synchronisation.

    Returns:
        The ``Stats`` of the timed calls, in seconds.
    """
    dev = torch.device("cpu") if clock is not None and device is None else resolve_device(device)
    flush = _flush_buffer(dev) if flush_l2 else None
    # Events record on the current stream of the current device: make it ``dev``'s.
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        grad = _warm_up(fn, warmup, repeats, dev, backward, grad)

        def prepare() -> torch.Tensor | None:  # a fresh gradient per call, untimed
            return grad.clone() if backward else None

        if dev.type == "cuda" and clock is None:
            return Stats.from_samples(_event_times(
                repeats, dev, flush, prepare, lambda g: _call(fn, backward, g)))
        timer = clock if clock is not None else timeit.default_timer
        samples: list[float] = []
        for _ in range(repeats):
            if flush is not None:
                flush.zero_()
            g = prepare()
            t0 = timer()
            out = _call(fn, backward, g)
            if clock is None:
                synchronize(dev)
            samples.append(timer() - t0)
            del out
    return Stats.from_samples(samples)


def graph_time(fn: Callable[[], Any], *, warmup: int = 3, repeats: int = 10,
               device: torch.device | str | None = None, flush_l2: bool = False,
               backward: bool = False, grad: torch.Tensor | None = None) -> Stats:
    """Time replays of a CUDA graph of one call of ``fn()`` (with its backward): the
    device time of the call's kernels, without the host's Python and launch overhead.

    Use it for kernels whose device time is shorter than the host time of calling them
    (``measure``'s figure is then host time). The arguments are ``measure``'s; after the
    warm-up one call is captured and ``repeats`` replays are timed between CUDA events.
    The capture's outputs are static: each replay writes the same tensors, and the
    gradient fed to backward is copied into one static buffer before each replay
    (untimed).
    """
    dev = resolve_device(device)
    if dev.type != "cuda":
        raise ValueError(f"graph_time needs a CUDA device, got {dev}")
    flush = _flush_buffer(dev) if flush_l2 else None
    with torch.cuda.device(dev):
        grad = _warm_up(fn, warmup, repeats, dev, backward, grad)
        static_grad = grad.clone() if backward else None
        # PyTorch's rule for capturing autograd: warm up on a side stream first, so that
        # the lazily made state (autograd's per-device streams, workspaces) exists before
        # the capture begins.
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                _call(fn, backward, static_grad)
        torch.cuda.current_stream(dev).wait_stream(side)
        synchronize(dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _call(fn, backward, static_grad)  # kept alive while the replays write it
        # A graph launch costs the host a few microseconds, and the flush kernel before
        # each start keeps the device busy meanwhile: no host gap lands in the timed region.
        samples = _event_times(
            repeats, dev, flush,
            # Some backwards (Liger's) write into the gradient: restore it before each replay.
            prepare=lambda: static_grad.copy_(grad) if backward else None,
            run=lambda _: graph.replay())
        del out
    return Stats.from_samples(samples)


def _call(fn: Callable[[], Any], backward: bool, grad: torch.Tensor | None) -> Any:
    """``fn()``, then (with ``backward``) backward from its output with ``grad``."""
    out = fn()
    if backward:
        _first_tensor(out).backward(grad)
    return out


def _event_times(repeats: int, dev: torch.device, flush: torch.Tensor | None,
                 prepare: Callable[[], Any], run: Callable[[Any], Any]) -> list[float]:
    """Seconds of ``run(prepare())`` per call, between two CUDA events each.

    One pair of events per call and a single synchronisation at the end: the host queues
    the calls back to back, as a training loop does, so host overhead shows only where it
    exceeds the device time (``triton.testing.do_bench`` works so too). The L2 flush and
    ``prepare`` are queued before each start event: untimed.
    """
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for start, end in zip(starts, ends):
        if flush is not None:
            flush.zero_()
        arg = prepare()
        start.record()
        run(arg)
        end.record()
    torch.cuda.synchronize(dev)
    return [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]


def paired_windows(fns: dict[str, Callable[[], Any]], *, rounds: int, window: int,
                   device: torch.device | str = "cpu", warmup: int = 3) -> dict[str, dict]:
    """Time several variants in short windows, paired round by round.

    On a host whose speed drifts by tens of percent within seconds, long windows per
    variant cannot resolve a few percent. Here each round times a window of ``window``
    back-to-back calls of every variant (one untimed call before each window) and compares
    each variant with the first one *within the round*: the median of those per-round
    ratios cancels the drift the window means do not. The order is balanced: rounds come
    in pairs, the second the first reversed, and each pair rotates the order by one, so
    every variant runs as often before the baseline as after it, at the same distance
    (a drift within a round then favours neither).

    Args:
        fns: the variants by name, each one call (a training step, say); the first is the
            baseline.
        rounds: windows per variant.
        window: timed calls per window.
        device: waited for around each window.
        warmup: untimed calls of every variant before the first round.

    Returns:
        Per variant: ``times_ms`` (ms per call, one per round), ``median_ms``, ``min_ms``,
        ``ratio`` (median over rounds of the baseline's time over the variant's; > 1: the
        variant is faster), ``ratio_q1`` and ``ratio_q3`` (its quartiles) and ``diff_ms``
        (median of the variant's time minus the baseline's).
    """
    if rounds < 1 or window < 1 or not fns:
        raise ValueError("paired_windows needs variants, rounds >= 1 and window >= 1")

    def timed(fn: Callable[[], Any], calls: int) -> float:
        fn()
        synchronize(device)
        start = timeit.default_timer()
        for _ in range(calls):
            fn()
        synchronize(device)
        return (timeit.default_timer() - start) / calls * 1e3

    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for rnd in range(rounds):
        shift = (rnd // 2) % len(names)
        order = names[shift:] + names[:shift]
        for name in (order[::-1] if rnd % 2 else order):
            times[name].append(timed(fns[name], window))
    base = times[names[0]]
    out = {}
    for name, own in times.items():
        ratios = [b / t for t, b in zip(own, base)]
        q1, _, q3 = statistics.quantiles(ratios, n=4) if rounds > 1 else (ratios[0],) * 3
        out[name] = {"times_ms": own, "median_ms": statistics.median(own), "min_ms": min(own),
                     "ratio": statistics.median(ratios), "ratio_q1": q1, "ratio_q3": q3,
                     "diff_ms": statistics.median(t - b for t, b in zip(own, base))}
    return out
