"""All-reduce benchmark: spawns its own ranks, sweeps backend x device x size x world size.

Each (backend, device, world size) cell starts ``world_size`` fresh processes that
join one process group through a ``file://`` rendezvous in a temporary folder (no
ports), time ``all_reduce`` at every size, and report the slowest rank's time per
call (a collective is done when its last rank is done). Bandwidth follows the
nccl-tests conventions:

* algbw = bytes / time
* busbw = algbw * 2 (n - 1) / n: the bytes each rank must send and receive in a
  ring all-reduce, so busbw is comparable across world sizes and with link speed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from lab2bench.report import progress as _progress
from lab2bench.timing import Stats

KB = 1024
MB = 1024 * 1024
GB = 1024 * 1024 * 1024
#: The handout's sizes: 512 KB to 1 GB of float32.
DEFAULT_SIZES = (512 * KB, 1 * MB, 10 * MB, 50 * MB, 100 * MB, 500 * MB, 1 * GB)
DEFAULT_WORLD_SIZES = (2, 4, 6)


class CommBenchError(RuntimeError):
    """A rank raised, died or did not finish within the timeout."""


def bus_bandwidth(algbw: float, world_size: int) -> float:
    """Bus bandwidth of a ring all-reduce: ``algbw * 2 (n - 1) / n``."""
    return algbw * 2 * (world_size - 1) / world_size


def parse_size(text: str) -> int:
    """Parse ``"512KB"``, ``"10MB"``, ``"1GB"``, ``"4096"`` (binary units: 1 KB = 1024 B)."""
    s = text.strip().upper().replace("IB", "B")
    number, scale = s, 1
    for suffix, unit in (("GB", GB), ("MB", MB), ("KB", KB), ("G", GB), ("M", MB), ("K", KB),
                         ("B", 1)):
        if s.endswith(suffix):
            number, scale = s[: -len(suffix)].strip(), unit
            break
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (use e.g. 512KB, 10MB, 1GB)") from None
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return int(value * scale)


def format_size(nbytes: int) -> str:
    """``524288`` -> ``"512KB"``, ``1073741824`` -> ``"1GB"`` (binary units)."""
    for unit, scale in (("GB", GB), ("MB", MB), ("KB", KB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def _rank_main(rank: int, world_size: int, backend: str, device_type: str, init_file: str,
               sizes: list[int], dtype: torch.dtype, warmup: int, repeats: int,
               pg_timeout: float, results: Any) -> None:
    """One rank: join the group, time all_reduce at every size, send rank 0's figures."""
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)  # the ranks share the machine's cores
        if device_type == "cuda":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            device = torch.device("cpu")
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=pg_timeout))
        try:
            out = []
            itemsize = torch.empty((), dtype=dtype).element_size()
            for size in sizes:
                numel = max(1, size // itemsize)
                data = torch.full((numel,), float(rank + 1), dtype=dtype, device=device)
                dist.all_reduce(data)
                expected = world_size * (world_size + 1) / 2
                got = float(data[0].item())
                if abs(got - expected) > 1e-3 * expected:
                    raise RuntimeError(f"all_reduce gave {got}, expected {expected}")
                for _ in range(warmup):
                    dist.all_reduce(data)
                times = []
                for _ in range(repeats):
                    dist.barrier()  # start together: otherwise one rank's wait is timed
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    t0 = time.perf_counter()
                    dist.all_reduce(data)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    times.append(time.perf_counter() - t0)
                # The slowest rank decides when each call was done.
                slowest = torch.tensor(times, dtype=torch.float64, device=device)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                out.append({"size_bytes": numel * itemsize, "numel": numel,
                            "samples_s": slowest.cpu().tolist()})
                del data
            results.put((rank, True, out if rank == 0 else None))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report everything to the parent, KeyboardInterrupt included
        results.put((rank, False, traceback.format_exc()))


def _context() -> Any:
    # A forkserver that imported torch once starts each rank in milliseconds; spawn
    # would import torch again in every rank, and fork is unsafe with threads/CUDA.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "lab2bench.comm"])
    return ctx


def _run_cell(backend: str, device_type: str, world_size: int, sizes: list[int],
              dtype: torch.dtype, warmup: int, repeats: int, timeout: float) -> list[dict]:
    ctx = _context()
    results = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="lab2bench-rdzv-")
    init_file = os.path.join(tmp, "rendezvous")
    procs = []
    saved_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        for rank in range(world_size):
            p = ctx.Process(target=_rank_main, daemon=True,
                            args=(rank, world_size, backend, device_type, init_file, sizes,
                                  dtype, warmup, repeats, timeout, results))
            p.start()
            procs.append(p)
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(got) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(got))
                raise CommBenchError(f"ranks {missing} did not finish within {timeout:.0f}s")
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if r not in got and not p.is_alive() and p.exitcode not in (0, None)]
                if not dead:
                    continue
                try:  # its traceback may still be on the way
                    rank, ok, payload = results.get(timeout=2.0)
                except queue.Empty:
                    raise CommBenchError(
                        f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}"
                    ) from None
            if not ok:
                raise CommBenchError(f"rank {rank} of {world_size} raised:\n{payload}")
            got[rank] = payload
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        return got[0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if saved_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved_threads
        shutil.rmtree(tmp, ignore_errors=True)


def _infeasible(backend: str, device: str, world_size: int, max_bytes: int,
                dtype: torch.dtype) -> str | None:
    """Why this cell cannot run here, or None."""
    import torch.distributed as dist

    if not dist.is_available():
        return "torch.distributed is not available in this build"
    if backend == "nccl":
        if device != "cuda":
            return "nccl needs CUDA tensors"
        if not dist.is_nccl_available():
            return "nccl is not available in this build"
    if backend == "gloo" and not dist.is_gloo_available():
        return "gloo is not available in this build"
    if device == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count < world_size:
            return f"needs {world_size} GPUs (one per rank), {count} here"
    if device == "cpu":
        import psutil

        # Each rank holds the tensor plus Gloo's buffers: about 3 copies.
        need = 3 * world_size * max_bytes
        available = psutil.virtual_memory().available
        if need > available:
            return (f"needs about {need / GB:.1f} GB of RAM for {world_size} ranks of "
                    f"{format_size(max_bytes)}, {available / GB:.1f} GB available")
    return None


def allreduce_sweep(
    *,
    backends: Sequence[str] = ("gloo",),
    devices: Sequence[str] = ("cpu",),
    sizes_bytes: Sequence[int] = DEFAULT_SIZES,
    world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES,
    warmup: int = 5,
    repeats: int = 20,
    timeout: float = 600.0,
    dtype: torch.dtype = torch.float32,
    on_error: str = "raise",
    show_progress: bool | None = None,
) -> list[dict[str, Any]]:
    """Time ``all_reduce`` (sum) over every backend x device x world size x size.

    Args:
        backends: ``"gloo"`` and/or ``"nccl"``.
        devices: ``"cpu"`` and/or ``"cuda"``; on CUDA rank r uses GPU r.
        sizes_bytes: tensor sizes in bytes (rounded down to whole elements).
        world_sizes: numbers of ranks.
        warmup: untimed all-reduces per size.
        repeats: timed all-reduces per size (each preceded by a barrier).
        timeout: seconds one (backend, device, world size) cell may take; past it its
            ranks are killed and the cell fails.
        dtype: element type of the tensors.
        on_error: ``"raise"`` raises ``CommBenchError`` when a cell fails; ``"record"``
            adds a row with ``status="failed"`` and the error in ``note``, and goes on.
        show_progress: a progress bar over the cells (default: when stderr is a tty).

    Returns:
        One dict per (backend, device, world size, size): ``status`` ``"ok"`` with
        ``time_ms`` (median of the slowest rank per call), ``mean_ms``, ``std_ms``,
        ``min_ms``, ``max_ms``, ``algbw_gbps`` and ``busbw_gbps`` (1e9 bytes/s); or one
        dict per infeasible cell with ``status="skipped"`` (or ``"failed"``) and a
        ``note`` saying why, with ``size_bytes`` None.
    """
    backends = [b.lower() for b in backends]
    devices = [d.lower() for d in devices]
    for b in backends:
        if b not in ("gloo", "nccl"):
            raise ValueError(f"unknown backend {b!r}; use 'gloo' or 'nccl'")
    for d in devices:
        if d not in ("cpu", "cuda"):
            raise ValueError(f"unknown device {d!r}; use 'cpu' or 'cuda'")
    sizes = [int(s) for s in sizes_bytes]
    if not sizes or any(s <= 0 for s in sizes):
        raise ValueError(f"sizes_bytes must be positive, got {list(sizes_bytes)}")
    if not world_sizes or any(int(w) < 1 for w in world_sizes):
        raise ValueError(f"world_sizes must be >= 1, got {list(world_sizes)}")
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got {warmup}, {repeats}")
    if on_error not in ("raise", "record"):
        raise ValueError(f"on_error must be 'raise' or 'record', got {on_error!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")

    cells = [(b, d, int(w)) for b in backends for d in devices for w in world_sizes]
    rows: list[dict[str, Any]] = []
    for backend, device, world_size in _progress(cells, description="all-reduce",
                                                 disable=None if show_progress is None
                                                 else not show_progress):
        base = {"backend": backend, "device": device, "world_size": world_size,
                "dtype": str(dtype).replace("torch.", "")}
        reason = _infeasible(backend, device, world_size, max(sizes), dtype)
        if reason is not None:
            rows.append({**base, "size_bytes": None, "status": "skipped", "note": reason})
            continue
        try:
            measured = _run_cell(backend, device, world_size, sizes, dtype, warmup, repeats,
                                 timeout)
        except CommBenchError as err:
            if on_error == "raise":
                raise
            rows.append({**base, "size_bytes": None, "status": "failed", "note": str(err)})
            continue
        for item in measured:
            stats = Stats.from_samples(item["samples_s"])
            algbw = item["size_bytes"] / stats.median
            rows.append({
                **base,
                "size_bytes": item["size_bytes"],
                "size": format_size(item["size_bytes"]),
                "status": "ok",
                "time_ms": stats.median_ms,
                "mean_ms": stats.mean_ms,
                "std_ms": stats.std_ms,
                "min_ms": stats.min_ms,
                "max_ms": stats.max_ms,
                "algbw_gbps": algbw / 1e9,
                "busbw_gbps": bus_bandwidth(algbw, world_size) / 1e9,
                "repeats": stats.n,
                "note": "",
            })
    return rows
