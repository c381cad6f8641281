"""Where a run's wall clock goes, and its goodput.

A :class:`WallClock` splits one rank's wall clock into the phases of :data:`PHASES`. It is
always in exactly one phase: the training loop switches it (:meth:`WallClock.switch`,
:meth:`WallClock.phase`) at the points where the device is idle (after the fetches that
wait for the steps' results), so every second between the start and
:meth:`WallClock.split` lands in one phase and the parts add up to the wall clock.

* ``startup``: from the launch of ``lab2-train`` (the time the command line stored in
  :data:`START_ENV`; without it, from the clock's creation, when the trainer starts
  building the model) to the first training step: imports, process-group set-up, model,
  data and checkpoint loading, compilation set-up.
* ``compilation``: the first step of the run (or of the resumed part) less a steady step,
  the mean step time of the timed windows after it; carved out of ``training`` by
  :meth:`WallClock.split`. It is everything the first step costs beyond a steady one:
  ``torch.compile``'s tracing and code generation, and in an eager run the allocator's
  and the kernels' first-call warm-up. Compilation inside a phase entered with
  ``carve_compilation`` (evaluation: its first pass compiles the graphs without
  gradients) is added, as dynamo accounts it (:func:`dynamo_compile_seconds`), and taken
  out of that phase.
* ``training``: the training steps, with the fetches of their losses and gradient norms.
* ``evaluation``, ``sampling``: the validation passes and the text sample.
* ``checkpoint``: the time checkpoint writing keeps the training loop waiting: whatever
  runs under :func:`checkpoint_stall`.
* ``other``: reporting (log lines, metrics file, loss curve, summary) and profiler traces.

**Goodput** is ``training`` over the wall clock, in (0, 1].

Start-up is itself split where the trainer marks it, so that a slow start says which part
of it was slow. Before the clock exists, :func:`mark_launch` names parts of the launch
(``imports``: torch and the trainer's modules; ``device``: the GPU's runtime and the
process group); ``launch`` is what is left of the time from the command to the clock's
creation (spawning the ranks, reading the settings). Then come one part per
:meth:`WallClock.mark` (``data``, ``model``, ...) and ``rest``, what followed the last
mark.

:func:`checkpoint_stall` is the one hook the checkpoint code needs: it wraps the part of a
save (or of the wait for an asynchronous one) that blocks the training loop, and counts it
as ``checkpoint`` on the clock that is running (:meth:`WallClock.active`). Nested calls
count once; calls from other threads (a background writer) and calls without a running
clock count nothing.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

#: The phases, in the order reports list them.
PHASES = ("startup", "compilation", "training", "evaluation", "sampling", "checkpoint", "other")
#: The phases a clock is switched to (compilation is carved out of training afterwards).
SWITCHED = tuple(p for p in PHASES if p != "compilation")
#: The environment variable in which ``lab2-train`` stores its start (seconds since the
#: epoch, ``time.time()``) for the ranks it launches.
START_ENV = "LAB2_TRAIN_START"

_active: WallClock | None = None
#: Parts of the launch marked in this process before its clock: (part, ``time.time()``).
_launch_marks: list[tuple[str, float]] = []


def launch_start() -> float | None:
    """The launch time that ``lab2-train`` stored in :data:`START_ENV`, taken out of the
    environment (so a later run in the same process does not reuse it); None without
    one or when it is not a number."""
    text = os.environ.pop(START_ENV, None)
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def dynamo_compile_seconds() -> float:
    """Seconds torch.compile's dynamo has spent compiling frames so far in this process
    (its ``compilation_time_metrics``); 0 where dynamo is not loaded or keeps no such
    account."""
    utils = sys.modules.get("torch._dynamo.utils")
    metrics = getattr(utils, "compilation_time_metrics", None) or {}
    return float(sum(sum(v) for k, v in metrics.items() if k.endswith("compile_inner")))


def mark_launch(part: str | None = None) -> None:
    """Without ``part``: store now as the launch time of the run (the command line's first
    act). With it: name ``part`` the launch's time since the previous mark (the clock
    created next in this process splits it so)."""
    if part is None:
        os.environ[START_ENV] = repr(time.time())
        _launch_marks.clear()
    else:
        _launch_marks.append((part, time.time()))


class WallClock:
    """One rank's wall clock, split by phase; it starts in ``startup``.

    Args:
        start: when the run was launched (``time.time()`` seconds; None: now). The time
            between it and the clock's creation counts as ``startup``.
    """

    def __init__(self, start: float | None = None) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        # "launch" first: the start-up not marked otherwise before the clock.
        self.startup_parts: dict[str, float] = {"launch": 0.0}
        if start is not None:
            now = time.time()
            self.seconds["startup"] = max(0.0, now - start)
            previous = start
            for part, at in _launch_marks:
                if start <= at <= now:
                    self.startup_parts[part] = (self.startup_parts.get(part, 0.0)
                                                + at - previous)
                    previous = at
            self.startup_parts["launch"] = max(0.0, now - previous)
        _launch_marks.clear()
        self.current = "startup"
        self._since = self._marked = time.perf_counter()
        self._compiled_in = dict.fromkeys(PHASES, 0.0)  # carved out of a phase by split
        self._thread = threading.get_ident()

    def mark(self, part: str, now: float | None = None) -> None:
        """Name ``part`` the start-up time since the last mark (or the clock's creation)
        to ``now`` (``time.perf_counter()``; None: now); nothing once start-up is over."""
        if self.current != "startup":
            return
        now = time.perf_counter() if now is None else now
        self.startup_parts[part] = self.startup_parts.get(part, 0.0) + now - self._marked
        self._marked = now

    def switch(self, phase: str) -> str:
        """Count the time since the last switch to the current phase and enter ``phase``;
        returns the phase left."""
        if phase not in SWITCHED:
            raise ValueError(f"phase must be one of {', '.join(SWITCHED)} (compilation is "
                             f"carved out of training); got {phase!r}")
        now = time.perf_counter()
        if self.current == "startup":
            self.mark("rest", now)  # what followed the last mark: start-up's parts add up
        self.seconds[self.current] += now - self._since
        self._since = now
        left, self.current = self.current, phase
        return left

    @contextlib.contextmanager
    def phase(self, phase: str, *, carve_compilation: bool = False) -> Iterator[None]:
        """Count the block as ``phase``, then go back to the phase it interrupted; with
        ``carve_compilation``, what dynamo spends compiling in it counts as compilation."""
        compiled = dynamo_compile_seconds() if carve_compilation else 0.0
        began = time.perf_counter()
        left = self.switch(phase)
        try:
            yield
        finally:
            self.switch(left)
            if carve_compilation:
                spent = dynamo_compile_seconds() - compiled
                self._compiled_in[phase] += min(max(0.0, spent), time.perf_counter() - began)

    @contextlib.contextmanager
    def active(self) -> Iterator[WallClock]:
        """Make this the clock that :func:`checkpoint_stall` counts on, for the block."""
        global _active
        before, _active = _active, self
        try:
            yield self
        finally:
            _active = before

    def split(self, first_step_s: float | None = None, steady_step_s: float | None = None
              ) -> dict[str, Any]:
        """The wall clock so far and its parts (seconds, ``<phase>_s``), with ``goodput``.

        Args:
            first_step_s: the first training step's time (None: no step yet).
            steady_step_s: a steady step's time (None: not known yet; compilation is then
                reported as 0 and stays in training).
        """
        now = time.perf_counter()
        parts = dict(self.seconds)
        parts[self.current] += now - self._since
        if first_step_s is not None and steady_step_s is not None:
            parts["compilation"] = min(parts["training"], max(0.0, first_step_s - steady_step_s))
            parts["training"] -= parts["compilation"]
        for name, seconds in self._compiled_in.items():
            carved = min(seconds, parts[name])
            parts[name] -= carved
            parts["compilation"] += carved
        wall = sum(parts.values())
        out: dict[str, Any] = {"wall_s": wall}
        out.update({f"{name}_s": parts[name] for name in PHASES})
        out["goodput"] = parts["training"] / wall if wall > 0 else None
        out["startup_parts"] = dict(self.startup_parts)
        return out


@contextlib.contextmanager
def checkpoint_stall() -> Iterator[None]:
    """Count the block as a checkpoint stall of the running clock (see the module
    docstring); wrap the part of a save that keeps training waiting."""
    clock = _active
    if clock is None or threading.get_ident() != clock._thread or clock.current == "checkpoint":
        yield
        return
    with clock.phase("checkpoint"):
        yield


def describe(split: dict[str, Any]) -> str:
    """One line of the split: ``"<wall> s: start-up <s> s, ..., goodput <g>%"``."""
    names = {"startup": "start-up", "compilation": "compilation", "training": "training steps",
             "evaluation": "evaluation", "sampling": "sampling", "checkpoint": "checkpoint stalls",
             "other": "other"}
    parts = ", ".join(f"{names[p]} {split[f'{p}_s']:.1f} s" for p in PHASES)
    goodput = split.get("goodput")
    tail = f"; goodput {goodput:.1%}" if goodput is not None else ""
    return f"{split['wall_s']:.1f} s: {parts}{tail}"
