"""Process setup and the elastic launch.

There is one launch path. ``lab2-train --nproc N`` runs the elastic agent that ``torchrun``
runs (:func:`torch.distributed.launcher.api.elastic_launch`) in this process, for one node
of N ranks with a c10d rendezvous on localhost (port 0: the system picks a free one);
several machines run ``torchrun`` on each. Either way every rank enters through
:func:`run_rank`, which joins the process group from the elastic agent's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and ends up with a
:class:`DistContext` naming its rank, the world size and its device.

The ranks are supervised by :mod:`lab2_trainer.runtime.supervise`: they die with their launcher,
take SIGTERM as Ctrl-C, and a rank that fails or goes silent is named.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lab2_trainer.config import EXIT_BAD_INPUT, Diverged, UsageError
from lab2_trainer.runtime.run_folder import WriteFailed, write_failure
from lab2_trainer.runtime.supervise import (
    FAILED,
    PEER_LOST,
    TIMED_OUT,
    LaunchWatch,
    RankGuard,
    exit_code_for,
    is_peer_lost_error,
    is_timeout_error,
    make_watch_folder,
    signal_name,
)
from lab2_trainer.runtime.wall_clock import mark_launch
from lab2sys.processes import threads_per_rank


# ------------------------------------------------------------ process setup and launch
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
    """Join the process group the elastic agent describes in the environment (torchrun's or
    ``--nproc``'s: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = rank_device(device_type, local_rank)
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method="env://", rank=rank, world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    mark_launch("device")
    return DistContext(rank, world, local_rank, device)


DEFAULT_TIMEOUT_S = 300.0


def _say(line: str) -> None:
    print(f"lab2-train: {line}", file=sys.stderr, flush=True)


def run_rank(fn: Callable[..., Any], args: tuple, device_type: str, timeout_s: float,
             folder: str | None = None, launcher_pid: int | None = None,
             threads: int | None = None) -> int:
    """The entry of every rank, local (the elastic agent of :func:`spawn_local` runs it) or
    started by ``torchrun``: guard the rank (:class:`lab2_trainer.runtime.supervise.RankGuard`),
    join the process group and run ``fn(ctx, *args)``; return the rank's exit code, having
    printed one message when it failed.

    Args:
        fn: takes a :class:`DistContext` first.
        args: the rest of ``fn``'s arguments.
        device_type: "cpu" (Gloo) or "cuda" (NCCL, the GPU of the local rank).
        timeout_s: the process group's collective timeout (``--timeout``).
        folder: the local run's watch folder (None under ``torchrun``).
        launcher_pid: the local launcher's pid (None: the parent, torchrun's agent).
        threads: a local rank's intra-op threads. Such a rank, when it failed or was
            stopped, ends at once, without the interpreter's shutdown (where threads of the
            torch and Gloo runtimes may still call into a half-torn-down Python).
    """
    if threads is not None:
        torch.set_num_threads(threads)
    rank = int(os.environ.get("RANK", "0"))
    if not os.environ.get("PYTHONFAULTHANDLER"):
        # The elastic agent turns on faulthandler's stack dumps in every rank: a rank killed
        # by a fatal signal (a truncated memory map's SIGBUS) is one line of the launcher's.
        faulthandler.disable()
    guard = RankGuard(rank, folder, launcher_pid).start()
    signalled = False
    try:
        ctx = init_from_env(device_type, timeout_s)
        fn(ctx, *args)
        dist.destroy_process_group()
        code = 0
    except UsageError as exc:
        print(f"lab2-train: error: {exc}", file=sys.stderr, flush=True)
        guard.mark(FAILED)
        code = EXIT_BAD_INPUT
    except KeyboardInterrupt as exc:
        signalled = True
        code = exit_code_for(exc)
    except BaseException as exc:
        if is_timeout_error(exc):
            guard.mark(TIMED_OUT)
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
            _say(f"rank {rank} gave up waiting for the other ranks after --timeout "
                 f"{timeout_s:g} s ({reason})")
        elif is_peer_lost_error(exc):
            # Another rank is gone: this rank's broken collective is a consequence, not a
            # second story. A local launcher names the cause; under torchrun, say it.
            guard.mark(PEER_LOST)
            if folder is None:
                _say(f"rank {rank} stopped: another rank closed its connection "
                     "mid-collective")
        elif isinstance(exc, Diverged):  # every rank at the same step: rank 0 says it
            guard.mark(FAILED)
            if rank == 0:
                print(f"lab2-train: error: {exc}", file=sys.stderr, flush=True)
        elif isinstance(exc, WriteFailed):  # a save of every rank failed: rank 0 says it
            guard.mark(FAILED)
            if rank == 0:
                _say(f"rank {rank} failed: {exc}")
        elif write_failure(exc) is not None:  # a full disk: one line, not a traceback
            guard.mark(FAILED)
            _say(f"rank {rank} failed: {write_failure(exc)}")
        else:
            guard.mark(FAILED)
            _say(f"rank {rank} failed:\n{traceback.format_exc()}")
        code = 1
    finally:
        guard.stop(signalled=signalled)
        if guard.orphaned and folder is None and os.environ.get("LOCAL_RANK", "0") == "0":
            # torchrun's agent (which hosts the store) is gone: its ranks stop; one says so.
            _say(f"rank {rank} stopped: its launcher, torchrun's agent (pid "
                 f"{guard.parent_pid}), is gone; the ranks of this node stop with it")
    if code and threads is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


#: The loggers of the elastic agent and of its worker processes: quiet during a local
#: launch, where ``lab2-train`` says in one line what happened (a rank's failure is its own
#: message).
_AGENT_LOGGERS = (
    "torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
_AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def spawn_local(nproc: int, device_type: str, fn: Callable[..., Any], *args: Any,
                timeout_s: float = DEFAULT_TIMEOUT_S,
                stop_note: Callable[[], str] | None = None) -> int:
    """Run ``fn(ctx, *args)`` on ``nproc`` local ranks through torch.distributed's elastic
    agent (one node, c10d rendezvous on localhost, no restarts); return the first failing
    exit code (0 when all succeed).

    On the CPU the ranks are forked (this process has imported torch already, which takes
    seconds on a small machine); on GPUs they are spawned fresh, since a fork must not
    inherit a CUDA context. When one rank fails the agent stops the others at once (SIGTERM,
    then SIGKILL after 5 s). The ranks die with this process, and a rank without a heartbeat
    for ``timeout_s`` is killed and named (:class:`LaunchWatch`). SIGTERM or Ctrl-C
    here stops the ranks in order; the watch folder is always removed.

    Args:
        nproc: number of ranks.
        device_type: "cpu" (Gloo) or "cuda" (NCCL, one GPU per rank).
        fn: module-level function taking a :class:`DistContext` first.
        timeout_s: the process group's collective timeout, and how long a rank may
            go without a heartbeat.
        stop_note: what to say of the checkpoints when the run is stopped by a signal
            (asked once the ranks are stopped).
    """
    import logging

    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if device_type == "cuda" and nproc > torch.cuda.device_count():
        raise UsageError(f"--nproc {nproc} needs {nproc} GPUs; {torch.cuda.device_count()} visible")
    folder = make_watch_folder()
    threads = threads_per_rank(nproc)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"lab2-train-{os.getpid()}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
        monitor_interval=0.1, start_method="fork" if device_type == "cpu" else "spawn",
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(folder, "logs")), shutdown_timeout=5)
    handlers = {sig: signal.getsignal(sig) for sig in _AGENT_SIGNALS}
    loggers = [logging.getLogger(name) for name in _AGENT_LOGGERS]
    quiet = logging.NullHandler()
    saved_logging = [(log.propagate, log.handlers[:]) for log in loggers]
    for log in loggers:
        log.propagate = False
        log.handlers = [quiet]
    # Ranks inherit the environment: OpenMP must not start a thread per core in each.
    saved_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    watch = LaunchWatch(folder, nproc, timeout_s).start()
    try:
        elastic_launch(config, run_rank)(fn, args, device_type, timeout_s, folder,
                                            os.getpid(), threads)
        return 0
    except ChildFailedError as exc:
        lines, code = watch.verdict(exc.failures)
        for line in lines:
            _say(line)
        return code
    except (SignalException, KeyboardInterrupt) as exc:
        if isinstance(exc, SignalException):
            sig = exc.sigval
            code = 128 + int(sig)
        else:
            code = exit_code_for(exc)
            sig = signal.SIGTERM if code == 143 else signal.SIGINT
        word = "interrupted" if sig == signal.SIGINT else f"stopped by {signal_name(sig)}"
        _say(f"{word}: stopping the ranks; "
             f"{stop_note() if stop_note else 'the last checkpoint is intact'}")
        return code
    finally:
        watch.stop()
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)
        for log, (propagate, kept) in zip(loggers, saved_logging):
            log.propagate, log.handlers = propagate, kept
        if saved_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved_threads
        shutil.rmtree(folder, ignore_errors=True)

