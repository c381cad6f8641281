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

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lab2bench.ranks import RankError, spawn_ranks
from lab2bench.report import progress as _progress

if TYPE_CHECKING:  # imported where used, so that the suite's --help does not load torch
    import torch

KB = 1024
MB = 1024 * 1024
GB = 1024 * 1024 * 1024
#: The handout's sizes: 512 KB to 1 GB of float32.
DEFAULT_SIZES = (512 * KB, 1 * MB, 10 * MB, 50 * MB, 100 * MB, 500 * MB, 1 * GB)
DEFAULT_WORLD_SIZES = (2, 4, 6)


class CommBenchError(RankError):
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


def _allreduce_rank(rank: int, world_size: int, spec: dict[str, Any]) -> list[dict] | None:
    """One rank (group already joined): time all_reduce at every size; rank 0 reports."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if spec["device"] == "cuda" \
        else torch.device("cpu")
    dtype, warmup, repeats = spec["dtype"], spec["warmup"], spec["repeats"]
    out = []
    itemsize = torch.empty((), dtype=dtype).element_size()
    for size in spec["sizes"]:
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
    return out if rank == 0 else None


def _run_cell(backend: str, device_type: str, world_size: int, sizes: list[int],
              dtype: torch.dtype, warmup: int, repeats: int, timeout: float) -> list[dict]:
    spec = {"device": device_type, "sizes": sizes, "dtype": dtype, "warmup": warmup,
            "repeats": repeats}
    try:
        # One thread per rank: the ranks share the machine's cores.
        return spawn_ranks(_allreduce_rank, world_size, spec, device=device_type,
                           backend=backend, timeout=timeout, threads=1,
                           preload=["lab2bench.comm"])[0]
    except RankError as err:
        raise CommBenchError(str(err)) from err


def _infeasible(backend: str, device: str, world_size: int, max_bytes: int,
                dtype: torch.dtype) -> str | None:
    """Why this cell cannot run here, or None."""
    import torch
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
    dtype: torch.dtype | None = None,
    on_error: str = "raise",
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
        dtype: element type of the tensors (default float32).
        on_error: ``"raise"`` raises ``CommBenchError`` when a cell fails; ``"record"``
            adds a row with ``status="failed"`` and the error in ``note``, and goes on.

    Returns:
        One dict per (backend, device, world size, size): ``status`` ``"ok"`` with
        ``time_ms`` (median of the slowest rank per call), ``mean_ms``, ``std_ms``,
        ``min_ms``, ``max_ms``, ``algbw_gbps`` and ``busbw_gbps`` (1e9 bytes/s); or one
        dict per infeasible cell with ``status="skipped"`` (or ``"failed"``) and a
        ``note`` saying why, with ``size_bytes`` None.
    """
    import torch

    from lab2bench.timing import Stats

    dtype = torch.float32 if dtype is None else dtype
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
    for backend, device, world_size in _progress(cells, description="all-reduce"):
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


# ------------------------------------------------------------------ counting collectives
#: The collectives ``count_collectives`` sees. ``_FACTOR`` is how many elements each sends
#: per rank in the ZeRO paper's accounting: an all-reduce of n elements 2n (a reduce-scatter
#: then an all-gather), a reduce-scatter its input's n, an all-gather its output's n, a
#: broadcast or a reduce n.
#: Each function's argument that sets the size: (position, keyword).
_COUNTED = {
    "all_reduce": (0, "tensor"),
    "reduce_scatter_tensor": (1, "input"),
    "all_gather_into_tensor": (0, "output_tensor"),
    "broadcast": (0, "tensor"),
    "reduce": (0, "tensor"),
    # torch >= 2.10: what FSDP2 calls (absent names are skipped).
    "reduce_scatter_single": (1, "input"),
    "all_gather_single": (0, "output_tensor"),
}
_FACTOR = {"all_reduce": 2, "allreduce": 2, "reduce_scatter_tensor": 1,
           "all_gather_into_tensor": 1, "broadcast": 1, "reduce": 1,
           "reduce_scatter_single": 1, "all_gather_single": 1, "all_to_all_single": 1}


class CollectiveCounter:
    """What :func:`count_collectives` recorded.

    Attributes:
        calls: ``(kind, numel, nbytes)`` of every collective, in issue order.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def reset(self) -> None:
        self.calls.clear()

    def _volume(self, index: int) -> int:
        return sum(_FACTOR[call[0]] * call[index] for call in self.calls)

    @property
    def volume_elements(self) -> int:
        """Elements sent per rank, counted as the ZeRO paper does (see ``_COUNTED``)."""
        return self._volume(1)

    @property
    def volume_bytes(self) -> int:
        """Bytes sent per rank, counted the same way."""
        return self._volume(2)

    def by_kind(self) -> dict[str, int]:
        """Number of calls of each kind."""
        out: dict[str, int] = {}
        for kind, _, _ in self.calls:
            out[kind] = out.get(kind, 0) + 1
        return out


class count_collectives:  # noqa: N801 (used as a function: ``with count_collectives() as c``)
    """Record every tensor collective this process issues from Python while active.

    Counts ``torch.distributed``'s ``all_reduce``, ``reduce_scatter_tensor``,
    ``all_gather_into_tensor``, ``broadcast`` and ``reduce`` (and ``reduce_scatter_single``
    and ``all_gather_single``, FSDP2's, where this torch has them), and
    ``ProcessGroup.allreduce`` called directly (as minddp does to skip the wrapper's
    checks), each once; and ``all_to_all_single``, counted as the elements this rank sends
    to the others (its input less the split it keeps). Collectives that PyTorch issues from C++
    (``DistributedDataParallel``'s reducer) are not seen, nor the small object collectives
    (``all_gather_object``, ``gather_object``).
    """

    def __init__(self) -> None:
        self.counter = CollectiveCounter()
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> CollectiveCounter:
        import threading

        import torch.distributed as dist

        depth = threading.local()
        calls = self.counter.calls

        def record(kind: str, tensors: list) -> None:
            numel = sum(t.numel() for t in tensors)
            calls.append((kind, numel, sum(t.numel() * t.element_size() for t in tensors)))

        def wrap_function(name: str, position: int, keyword: str, original: Any) -> Any:
            def counted(*args: Any, **kwargs: Any) -> Any:
                if not getattr(depth, "inside", 0):  # one collective may call another
                    record(name, [args[position] if len(args) > position else kwargs[keyword]])
                depth.inside = getattr(depth, "inside", 0) + 1
                try:
                    return original(*args, **kwargs)
                finally:
                    depth.inside -= 1

            return counted

        for name, (position, keyword) in _COUNTED.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._saved.append((dist, name, original))
            setattr(dist, name, wrap_function(name, position, keyword, original))

        original_allreduce = dist.ProcessGroup.allreduce

        def pg_allreduce(group: Any, tensors: Any, *args: Any, **kwargs: Any) -> Any:
            if not getattr(depth, "inside", 0):  # not already counted by dist.all_reduce
                record("allreduce", list(tensors) if isinstance(tensors, (list, tuple))
                       else [tensors])
            return original_allreduce(group, tensors, *args, **kwargs)

        original_a2a = getattr(dist, "all_to_all_single", None)
        if original_a2a is not None:
            def all_to_all(output: Any, input: Any, output_split_sizes: Any = None,
                           input_split_sizes: Any = None, *args: Any, **kwargs: Any) -> Any:
                group = args[0] if args else kwargs.get("group")
                own = (input_split_sizes[dist.get_rank(group)] if input_split_sizes
                       else input.numel() // dist.get_world_size(group))
                sent = input.numel() - own
                calls.append(("all_to_all_single", sent, sent * input.element_size()))
                return original_a2a(output, input, output_split_sizes, input_split_sizes,
                                    *args, **kwargs)

            self._saved.append((dist, "all_to_all_single", original_a2a))
            dist.all_to_all_single = all_to_all

        # Restored from the class's own entry: the attribute read above is pybind's unbound
        # function, which would not bind to the group when set back on the class.
        self._saved.append((dist.ProcessGroup, "allreduce",
                            vars(dist.ProcessGroup).get("allreduce", original_allreduce)))
        dist.ProcessGroup.allreduce = pg_allreduce
        return self.counter

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()
