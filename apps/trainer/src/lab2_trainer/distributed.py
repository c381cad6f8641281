"""Process setup: one process, N local ranks (``--nproc``), or ranks started by ``torchrun``.

Every rank ends up with a :class:`DistContext` naming its rank, the world size and its
device. Local ranks meet through a ``file://`` rendezvous in a fresh temporary folder (no
ports to collide); under ``torchrun`` the usual ``env://`` variables (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT) are read.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lab2_trainer.errors import UsageError
from lab2_trainer.supervise import (
    FAILED,
    TIMED_OUT,
    RankWatch,
    exit_code_for,
    is_timeout_error,
)
from lab2bench.ranks import (  # threads_per_rank: CPU threads per rank sharing the cores
    EXITED,
    RankError,
    RankGroup,
    rank_watch,
    threads_per_rank,
)

# Exit code of a rank that stopped on bad input (it already printed one line).
EXIT_BAD_INPUT = 2


@dataclass
class DistContext:
    """Where this process stands among the ranks.

    Attributes:
        rank: global rank.
        world_size: number of ranks.
        local_rank: rank on this machine (selects the GPU).
        device: the device this rank computes on.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        """Rank 0 writes files and prints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """A process group is running (even of size 1)."""
        return dist.is_available() and dist.is_initialized()

    def barrier(self) -> None:
        """Wait for every rank (a no-op without a process group)."""
        if self.distributed:
            dist.barrier()

    @classmethod
    def from_process_group(cls, device: torch.device | None = None) -> DistContext:
        """Context of a process whose default group is initialised already (or of a single
        process when none is)."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls(device=device or torch.device("cpu"))
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        return cls(rank, world, local_rank, device or torch.device("cpu"))


def resolve_device_type(requested: str) -> str:
    """``"auto"`` becomes ``"cuda"`` where a GPU is visible, else ``"cpu"``.

    Raises:
        UsageError: ``"cuda"`` asked for where there is none, or an unknown device type.
    """
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = requested.split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise UsageError(f"--device must be auto, cpu or cuda, got {requested!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda asked for, but no CUDA device is visible")
    return kind


def rank_device(device_type: str, local_rank: int) -> torch.device:
    """This rank's device: its own GPU by local rank, or the CPU."""
    if device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise UsageError(
                f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} visible"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def launched_by_torchrun() -> bool:
    """Whether the environment describes a rank started by ``torchrun`` (or similar)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_from_env(device_type: str, timeout_s: float = 600.0) -> DistContext:
    """Join the process group described by torchrun's environment variables."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = rank_device(device_type, local_rank)
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method="env://", rank=rank, world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    return DistContext(rank, world, local_rank, device)


def _rank_main(rank: int, world: int, spec: tuple) -> None:
    """One local rank (its process group is up): run ``fn(ctx, *args)``; on failure print
    one message and exit with the run's code."""
    device_type, timeout_s, fn, args = spec
    watch = rank_watch()
    try:
        device = rank_device(device_type, rank)
        fn(DistContext(rank, world, rank, device), *args)
    except UsageError as exc:
        print(f"lab2-train: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_BAD_INPUT)
    except KeyboardInterrupt as exc:
        sys.exit(exit_code_for(exc))
    except BaseException as exc:
        if is_timeout_error(exc):
            if watch is not None:
                watch.mark(rank, TIMED_OUT)
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
            print(f"lab2-train: rank {rank} gave up waiting for the other ranks after "
                  f"--timeout {timeout_s:g} s ({reason})", file=sys.stderr, flush=True)
        elif is_peer_lost_error(exc):
            # Another rank is gone (the launcher names it and how it ended): this rank's
            # broken collective is a consequence, not a second story.
            if watch is not None:
                watch.mark(rank, FAILED)
            print(f"lab2-train: rank {rank} stopped: another rank closed its connection "
                  "mid-collective", file=sys.stderr, flush=True)
        else:
            if watch is not None:
                watch.mark(rank, FAILED)
            print(f"lab2-train: rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr,
                  flush=True)
        sys.exit(1)


#: How a collective reports that a peer went away (Gloo's TCP transport, NCCL).
_PEER_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe",
              "remote process exited", "socket closed")


def is_peer_lost_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that failed because another rank went away."""
    text = str(exc).lower()
    return isinstance(exc, (RuntimeError, OSError)) and any(s in text for s in _PEER_LOST)


DEFAULT_TIMEOUT_S = 300.0


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _say(line: str) -> None:
    print(f"lab2-train: {line}", file=sys.stderr, flush=True)


def _report_failure(group: RankGroup, failed_rank: int | None, timeout_s: float) -> int:
    """After a rank failed: name what stopped (killed, signalled, frozen) and return the
    first failing exit code."""
    procs, watch = group.procs, group.watch
    if failed_rank is not None:  # it reported its failure; its exit code follows
        procs[failed_rank].join(timeout=5)
    # Give the others a moment to end (a rank stopped by a signal often ends just after
    # the peer whose collective it broke) and to print their own error line, then read
    # every exit code: the first failure seen is not always the cause.
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and any(p.exitcode is None for p in procs):
        time.sleep(0.05)
    time.sleep(0.2)
    codes = [p.exitcode for p in procs]
    why = watch.explain_stop(procs, timeout_s)
    group.frozen = tuple(r for r, _ in watch.silent_ranks(procs, 2.0))
    for rank, code in enumerate(codes):
        if code is not None and code < 0:
            _say(f"rank {rank} (pid {procs[rank].pid}) was killed by {_signal_name(-code)}")
        elif code in (130, 143):  # a signal to the rank alone: it stopped in order
            _say(f"rank {rank} (pid {procs[rank].pid}) was stopped by "
                 f"{'SIGTERM' if code == 143 else 'SIGINT'}")
    if why:
        _say(why)
    failed = [c for c in codes if c not in (None, 0)]
    return (failed[0] if failed[0] > 0 else 1) if failed else 1


def spawn_local(nproc: int, device_type: str, fn: Callable[..., Any], *args: Any,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """Run ``fn(ctx, *args)`` on ``nproc`` local ranks; return the first failing exit code
    (0 when all succeed).

    The ranks are :class:`lab2bench.ranks.RankGroup`'s. On the CPU they are forked (this
    process has imported torch already, which takes seconds on a small machine; a fork
    shares it); on GPUs they are spawned fresh, since a fork must not inherit a CUDA
    context. When one rank fails, the others are stopped at once instead of waiting in a
    collective for the timeout. The ranks die with this process
    (:mod:`lab2bench.supervise`); a rank without a heartbeat for ``timeout_s`` ends the
    run, named. SIGTERM here (see :func:`supervise.install_termination_handler`) stops the
    ranks in order, like Ctrl-C; the rendezvous folder is always removed.

    Args:
        nproc: number of ranks.
        device_type: "cpu" (Gloo) or "cuda" (NCCL, one GPU per rank).
        fn: module-level function taking a :class:`DistContext` first.
        timeout_s: the process group's collective timeout, and how long a rank may
            go without a heartbeat.
    """
    if device_type == "cuda" and nproc > torch.cuda.device_count():
        raise UsageError(f"--nproc {nproc} needs {nproc} GPUs; {torch.cuda.device_count()} visible")
    group = RankGroup(_rank_main, nproc, (device_type, timeout_s, fn, args),
                      device=device_type, pg_timeout=timeout_s,
                      threads=threads_per_rank(nproc),
                      start_method="fork" if device_type == "cpu" else "spawn",
                      rdzv_prefix="lab2-train-rdzv-", stop_grace=5.0, daemon=False,
                      watch_type=RankWatch)
    with group:
        try:
            group.collect(silence_limit=timeout_s)
            return 0
        except RankError as exc:
            if exc.kind == "silent":
                _say(f"{exc} (--timeout {timeout_s:g}); stopped or frozen. Ending the run.")
                return 1
            if exc.kind == "raised" and EXITED not in (exc.detail.splitlines() or [EXITED])[0]:
                # It failed before it could speak for itself (joining the process group).
                _say(f"rank {exc.rank} failed:\n{exc.detail}")
            return _report_failure(group, exc.rank, timeout_s)
        except KeyboardInterrupt as exc:
            code = exit_code_for(exc)
            _say(f"{'stopped by SIGTERM' if code == 143 else 'interrupted'}: stopping the "
                 "ranks; the last checkpoint is intact")
            return code
