"""Checks of the machine that must pass before any rank starts, so that a run that could
never work costs one line and exit code 2:

* :func:`check_memory`: the model, its gradients and AdamW state (plus the logits of one
  micro-batch) fit the memory this machine has (a lower bound: a run refused here could
  never have run), counted by arithmetic on the configuration
  (:mod:`lab2_trainer.models.shapes`), so that an absurd size is refused at once;
* :func:`check_compile`: ``--compile-backend`` and ``--compile-mode`` are torch.compile's;
* :func:`bf16_supported`: whether the device computes in bf16, which ``--precision`` and
  ``--compile`` left to the device (``auto``) are chosen by;
* :func:`check_fp8`: ``--precision fp8``'s needs (the shapes, no ``--tp``, a GPU of compute
  capability 8.9 or later, torchao), by :mod:`lab2_trainer.models.float8`'s rules.

(Paths are checked by :mod:`lab2_trainer.runtime.paths`, a checkpoint's fit by
:mod:`lab2_trainer.checkpoint.compat`, each setting's own range by its field in
:mod:`lab2_trainer.config`.)
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from lab2_trainer.config import UsageError
from lab2_trainer.models.shapes import (
    muon_parameter_count,
    rank_parameter_counts,
    training_state_bytes,
)

GIB = 1024**3


# Per process: the interpreter, torch and the data maps (a lower bound).
PROCESS_BYTES = 200 * 1024**2


#: torch.compile's own backends, which ``torch._dynamo.list_backends()`` may leave out of
#: its default listing (it hides the "debug" ones, aot_eager and eager among them).
BUILTIN_BACKENDS = ("inductor", "eager", "aot_eager")


def bf16_supported(device_type: str) -> bool:
    """Whether the ranks' device computes in bf16: a CUDA device that
    ``torch.cuda.is_bf16_supported()`` says does (Ampere and later); never the CPU."""
    if device_type != "cuda":
        return False
    try:
        import torch

        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    except Exception:  # noqa: BLE001 (no usable CUDA here: the ranks will say it)
        return False


def check_compile(backend: str, mode: str | None) -> None:
    """``--compile-backend`` names a backend torch.compile knows, and ``--compile-mode`` one
    of inductor's modes (the other backends take none), checked here rather than in every
    rank at its first step.

    Raises:
        UsageError: an unknown backend or mode.
    """
    try:
        import torch._dynamo

        known = set(torch._dynamo.list_backends(exclude_tags=())) | set(BUILTIN_BACKENDS)
    except Exception:  # noqa: BLE001 (no dynamo on this platform: the ranks will say it)
        return
    if backend not in known:
        import difflib

        close = difflib.get_close_matches(backend, sorted(known), n=2)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        raise UsageError(f"--compile-backend {backend!r} is not a torch.compile backend{hint}; "
                         f"choose one of {', '.join(sorted(torch._dynamo.list_backends()))}, "
                         f"{', '.join(BUILTIN_BACKENDS[1:])}")
    if mode is None or mode == "default":
        return
    if backend != "inductor":
        raise UsageError(f"--compile-mode {mode!r} is an inductor mode; --compile-backend "
                         f"{backend} takes none (drop --compile-mode)")
    try:
        from torch._inductor import list_mode_options

        modes = list(list_mode_options())
    except Exception:  # noqa: BLE001 (cannot list them: inductor will check)
        return
    if mode not in modes:
        raise UsageError(f"--compile-mode {mode!r} is not one of inductor's modes: "
                         f"{', '.join(modes)}")


def check_fp8(settings: Any, world_size: int, device_type: str) -> None:
    """For ``--precision fp8``: the blocks' shapes and a micro-batch's tokens are multiples
    of 16, no tensor parallelism, every local GPU of compute capability 8.9 or later, and
    torchao importable (:mod:`lab2_trainer.models.float8`); nothing for other precisions.

    Raises:
        UsageError: the first that fails, in one line.
    """
    if settings.precision != "fp8":
        return
    from lab2_trainer.models.float8 import device_problem, run_problem, torchao_problem

    dp = settings.data_parallel_size(world_size)
    micro = settings.batch_size // dp // settings.grad_accum
    tokens = micro * settings.model.context_length
    for problem in (lambda: run_problem(settings.model, tokens, settings.tp),
                    lambda: device_problem(device_type, world_size), torchao_problem):
        line = problem()
        if line is not None:
            raise UsageError(line)


def available_memory() -> int | None:
    """Bytes this process may still allocate: MemAvailable, capped by a cgroup limit."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        with contextlib.suppress(ValueError, OSError, AttributeError):
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    cgroups = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
               ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                "/sys/fs/cgroup/memory/memory.usage_in_bytes"))
    for limit_file, usage_file in cgroups:
        try:
            limit = Path(limit_file).read_text().strip()
            if limit != "max" and int(limit) < 2**60:
                found.append(int(limit) - int(Path(usage_file).read_text().strip()))
            break
        except (OSError, ValueError):
            continue
    return min(found) if found else None


def _fmt(n: int) -> str:
    if n < 1024 * GIB:
        return f"{n / GIB:,.1f} GiB"
    tib = n / (1024 * GIB)
    return f"{tib:,.1f} TiB" if tib < 1e6 else f"{tib:.2g} TiB"  # absurd sizes stay short


def check_memory(settings: Any, world_size: int, device_type: str, *,
                 available: int | None = None) -> None:
    """Refuse a run whose model cannot fit: weights, gradients and AdamW's two moments in
    fp32 (sharded over the ranks as :func:`lab2_trainer.models.shapes.training_state_bytes`
    says), the logits and their gradient for one micro-batch, and the process itself. On
    the CPU every local rank shares this machine's memory; on GPUs each rank needs it on
    its own device.

    Raises:
        UsageError: with the estimate and what is available.
    """
    # Under --tp each rank holds its share of the model, which the
    # sharding kind shards over the data-parallel ranks; the logits are a tp-th too.
    tp = max(1, getattr(settings, "tp", 1))
    dp = max(1, world_size // tp)
    n = rank_parameter_counts(settings.model, tp)["total"]
    micro = max(1, settings.batch_size // dp // max(1, settings.grad_accum))
    logits = 2 * 4 * micro * settings.model.context_length * settings.model.vocab_size // tp
    muon = (muon_parameter_count(settings.model)
            if getattr(settings, "optimizer", "adamw") == "muon" else 0)
    per_rank = training_state_bytes(n, settings.sharding, dp,
                                    getattr(settings, "reshard_after_forward", True),
                                    muon) + logits
    what = (f"{n:,} parameters{' per tensor-parallel rank' if tp > 1 else ''}: weights, "
            f"gradients and AdamW state in fp32 (sharded as --sharding {settings.sharding} "
            "shards them), and the logits of a micro-batch")
    hint = "make it smaller (--vocab-size, --d-model, --n-layers, --batch-size)"
    if device_type == "cuda":
        try:
            import torch

            smallest = min(torch.cuda.get_device_properties(i).total_memory
                           for i in range(min(world_size, torch.cuda.device_count())))
        except Exception:  # noqa: BLE001 (no answer from the driver: nothing to check)
            return
        if per_rank > smallest:
            raise UsageError(f"the model needs at least {_fmt(per_rank)} per GPU ({what}); "
                             f"the GPUs have {_fmt(smallest)}: {hint}")
        return
    need = world_size * (per_rank + PROCESS_BYTES)
    have = available if available is not None else available_memory()
    if have is not None and need > have:
        raise UsageError(f"the run needs at least {_fmt(need)} of memory ({what}, "
                         f"{world_size} rank(s)); this machine has {_fmt(have)} available: "
                         f"{hint}")
