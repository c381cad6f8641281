"""Saving sharded checkpoints while training goes on.

:meth:`Checkpointer.save` runs on every rank at a checkpoint step. Training stalls only
for the copy of this rank's parts (:mod:`lab2_trainer.checkpoint.parts`) into CPU
memory (pinned on CUDA, made a slice per step between steps, :meth:`Checkpointer.make_buffers`,
and reused); the write then runs on a background thread, while the next steps train:

1. ``torch.distributed.checkpoint.save`` of the copies into ``<out>/ckpt/step-N/``
   (emptied first by rank 0: a step saved again keeps nothing of an earlier write), its
   collectives on a Gloo process group of its own (never the training group, whose
   collectives the main thread issues meanwhile), each rank writing up to ``threads``
   files with as many threads (one per :data:`BYTES_PER_THREAD` of its part): one thread
   does not keep a disk busy (``docs/benchmarks/2026-12-03-h200-goodput.md``);
2. each rank checksums its share of the files written, ``threads`` files at a time;
3. rank 0 gathers the checksums and every rank's random generator states (taken at the
   save, :mod:`lab2_trainer.checkpoint.rng`), writes ``trainer.pt`` with them, then the
   manifest, last and atomically, then removes the step folders beyond ``--keep-last``
   (and the newer ones of a timeline a resume from an older step left:
   :func:`~lab2_trainer.checkpoint.folders.prune`).

At most one save is in flight: the next one (and the end of the run) waits for it first.
A failed write is reported in one line (:attr:`Checkpointer.error`); the previous
checkpoint stays as it was. With ``--no-ckpt-async`` the same work runs in the
foreground.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lab2_trainer.checkpoint.folders import (
    CKPT_DIR,
    MANIFEST,
    TRAINER_STATE,
    file_crc,
    prune,
    save_trainer_state,
    step_folder,
    write_manifest,
)
from lab2_trainer.checkpoint.parts import (
    Part,
    Placement,
    model_parts,
    state_holders,
    state_parts,
    write_parts,
    write_share,
)
from lab2_trainer.checkpoint.rng import KEY as RNG_BY_RANK
from lab2_trainer.checkpoint.rng import by_rank, rng_state
from lab2_trainer.runtime.run_folder import WriteFailed, refused_write

#: Seconds per step that :meth:`Checkpointer.make_buffers` spends making pinned buffers.
BUFFER_BUDGET_S = 0.05
#: A rank's part gets one writer thread (and file) per this many bytes, up to ``threads``:
#: small checkpoints stay one file per rank.
BYTES_PER_THREAD = 256 << 20


class Checkpointer:
    """Writes this rank's part of the run's checkpoints (create it on every rank, at the
    same point: it makes a process group).

    Args:
        out: the run folder (checkpoints go to ``<out>/ckpt/``).
        model, optimizer, sharding: what to save, as ``parallelize`` set it up.
        device: the rank's device (CUDA: the copies go to pinned memory).
        asynchronous: write in the background.
        keep_last: complete checkpoints kept (0: all).
        threads: writer threads (and files) per rank.
        layout: how tensor parallelism cut the model
            (:class:`~lab2_trainer.parallel.tensor.TensorLayout`), or None.
    """

    def __init__(self, out: str | os.PathLike, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, sharding: str, device: torch.device, *,
                 asynchronous: bool = True, keep_last: int = 1, threads: int = 8,
                 layout: Any = None) -> None:
        self.root = Path(out) / CKPT_DIR
        self.model, self.optimizer, self.sharding = model, optimizer, sharding
        self.placement = Placement.here(layout)
        self.device = device
        self.asynchronous = asynchronous
        self.keep_last = keep_last
        self.threads = threads
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        # DCP's collectives run here, on the writer thread, apart from training's.
        self.group = dist.new_group(backend="gloo") if self.distributed else None
        self._buffers: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self._pending: list[tuple[tuple[str, tuple[int, ...]], torch.Size,
                                  torch.dtype]] | None = None
        self._thread: threading.Thread | None = None
        self.error: str | None = None
        self.stalls: list[float] = []  # seconds training waited, per save
        self.final_wait = 0.0  # seconds the end of the run waited for the last save
        self.saved: list[Path] = []  # folders completed by this process

    # ------------------------------------------------------------------------ saving
    def make_buffers(self, budget_s: float = BUFFER_BUDGET_S) -> None:
        """Make some of the pinned buffers that saves copy into: for about ``budget_s``
        seconds, then return (CUDA only; nothing once all are made). The trainer calls this
        after each step from the second on, once the step's work is queued on the GPU.

        Pinned memory is slow to allocate (about 14 s for xl's 23.6 GB on an H200's host),
        and the allocation holds the CUDA driver: from a background thread it held up the
        training thread's launches, and 49 steps took 22 s more than steady ones; during
        the first step it doubled compilation (20 s to 40 s). A slice of it per step, while
        the GPU runs the step queued before, costs the GPU nothing
        (``docs/benchmarks/2026-12-03-h200-goodput.md``). A save makes what is still
        missing.
        """
        if self.device.type != "cuda":
            return
        if self._pending is None:  # the first call: what the saves will copy
            self._pending = self._expected()
        deadline = time.perf_counter() + budget_s
        while self._pending and time.perf_counter() < deadline:
            key, shape, dtype = self._pending.pop()
            try:
                self._buffers.setdefault(key, torch.empty(shape, dtype=dtype, pin_memory=True))
            except (RuntimeError, MemoryError):  # made again, at the save
                self._pending = []

    def save(self, step: int, trainer_state: dict[str, Any] | None) -> float:
        """Save the model, AdamW's state, every rank's random generator states (as they
        are now) and (on rank 0) ``trainer_state`` as step ``step``; every rank. Returns
        the seconds training stalled for it: waiting for the previous save, and the copy
        (and the write, in the foreground)."""
        start = time.perf_counter()
        self.report(self.wait())
        rng = rng_state(self.device)
        # Where the state lives is asked anew each time: zero1 rebuilds its buckets once.
        at = self.placement
        holders = state_holders(self.model, self.optimizer, self.sharding, at)
        staged = self._stage(write_share(
            model_parts(self.model, self.sharding, self.optimizer, at)
            + state_parts(holders, at)))
        folder = step_folder(self.root, step)
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            # Rewriting a step (a resume from an earlier one): not a checkpoint meanwhile.
            with contextlib.suppress(IsADirectoryError):  # emptied with the rest (_write)
                (folder / MANIFEST).unlink(missing_ok=True)
        if self.asynchronous:
            self._thread = threading.Thread(target=self._write_reporting,
                                            args=(folder, staged, trainer_state, step,
                                                  rng),
                                            name="checkpoint-writer", daemon=True)
            self._thread.start()
        else:
            self._write_reporting(folder, staged, trainer_state, step, rng)
        stall = time.perf_counter() - start
        self.stalls.append(stall)
        return stall

    def _expected(self) -> list[tuple[tuple[str, tuple[int, ...]], torch.Size, torch.dtype]]:
        """(buffer key, shape, dtype) of what :meth:`save` will copy on this rank, the
        optimizer's state included before it exists (its tensors of the parameter's shape,
        each optimizer's own, take their parameter's range and dtype)."""
        at = self.placement
        expected = model_parts(self.model, self.sharding, self.optimizer, at)
        for h in state_holders(self.model, self.optimizer, self.sharding, at):
            local = h.flat(h.tensor)
            expected += [h.held(what, torch.empty(local.shape, dtype=local.dtype,
                                                  device="meta"), at) for what in h.tensors]
        return [(_buffer_key(p), p.data.shape, p.data.dtype) for p in write_share(expected)]

    def _stage(self, parts: list[Part]) -> list[Part]:
        """Copies of ``parts`` in CPU memory (pinned on CUDA; buffers reused across saves),
        complete when this returns."""
        staged = []
        pin = self.device.type == "cuda"
        for p in parts:
            buf = self._buffers.get(_buffer_key(p))
            if buf is None or buf.shape != p.data.shape or buf.dtype != p.data.dtype:
                buf = torch.empty(p.data.shape, dtype=p.data.dtype, pin_memory=pin)
                self._buffers[_buffer_key(p)] = buf
            buf.copy_(p.data.detach(), non_blocking=pin)
            staged.append(Part(p.key, p.size, p.offsets, buf))
        if pin:
            torch.cuda.current_stream(self.device).synchronize()
        return staged

    def _write_reporting(self, folder: Path, staged: list[Part],
                         trainer_state: dict[str, Any] | None, step: int,
                         rng: dict[str, torch.Tensor]) -> None:
        try:
            self._write(folder, staged, trainer_state, step, rng)
        except BaseException as exc:  # noqa: BLE001 (reported by wait(), in one line)
            refused = refused_write(exc)  # a full disk: say so, not "CheckpointException"
            reason = (refused.strerror or str(refused)) if refused is not None else (
                str(exc).strip().splitlines()[0] if str(exc).strip() else "")
            self.error = (f"checkpoint of step {step} was not written ({type(exc).__name__}"
                          f"{': ' + reason if reason else ''}); the previous one is intact")
            if not self.asynchronous:
                raise

    def _write(self, folder: Path, staged: list[Part], trainer_state: dict[str, Any] | None,
               step: int, rng: dict[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint import FileSystemWriter

        if self.rank == 0:
            # A step written again (a resume from an earlier one, or after an interrupted
            # write) starts from an empty folder: nothing of the earlier write (a partial
            # shard of another world size, a FIFO) is listed in the new manifest or opened.
            # Safe: no rank writes before rank 0 has joined DCP's planning, after this.
            empty_folder(folder)
        else:
            with contextlib.suppress(OSError):  # else DCP's own mkdir fails, on every rank
                folder.mkdir(parents=True, exist_ok=True)
        nbytes = sum(p.data.numel() * p.data.element_size() for p in staged)
        threads = max(1, min(self.threads, nbytes // BYTES_PER_THREAD))
        writer = FileSystemWriter(str(folder), thread_count=threads, sync_files=True)
        write_parts(staged, writer, self.group)
        # The files of this step, from the folder itself: the metadata DCP returns does not
        # list them on every torch (its storage_data is None on some releases).
        # (Only what DCP wrote: rank 0 emptied the folder first; file_crc opens regular
        # files only.)
        names = sorted(n for n in os.listdir(folder) if n.endswith(".distcp"))
        if self.rank == 0:
            names.append(".metadata")
        mine = names[self.rank::self.world_size]
        with ThreadPoolExecutor(max(1, min(threads, len(mine)))) as pool:
            files = dict(zip(mine, pool.map(file_crc, [folder / n for n in mine])))
        if self.rank == 0 and ".metadata" not in files:
            files[".metadata"] = file_crc(folder / ".metadata")
        # One gather: each rank's checksums and random states (by global rank).
        everyone: list[Any] = [(files, rng)]
        if self.distributed:
            everyone = [None] * self.world_size if self.rank == 0 else None
            dist.gather_object((files, rng), everyone, dst=dist.get_global_rank(self.group, 0),
                               group=self.group)
        if self.rank == 0:
            for theirs, _ in everyone:
                files.update(theirs)
            if trainer_state is not None:
                trainer_state = {**trainer_state, RNG_BY_RANK: by_rank(
                    [states for _, states in everyone], self.placement.tp)}
            files[TRAINER_STATE] = save_trainer_state(folder, trainer_state)
            write_manifest(folder, step, files, world_size=self.world_size,
                           sharding=self.sharding, tp=self.placement.tp)
            prune(self.root, self.keep_last, step)
        self.saved.append(folder)

    # ------------------------------------------------------------------------ waiting
    def report(self, error: str | None) -> None:
        """One line on stderr for a background save that failed; training goes on."""
        if error is not None:
            print(f"lab2-train: warning: rank {self.rank}: {error}", file=sys.stderr,
                  flush=True)

    def finish(self) -> None:
        """Wait for the save in flight (the end of a run).

        Raises:
            WriteFailed: it failed (one line, every rank's: rank 0 prints it).
        """
        start = time.perf_counter()
        error = self.wait()
        self.final_wait = time.perf_counter() - start
        if error is not None:
            raise WriteFailed(error)

    def wait(self) -> str | None:
        """Wait for the save in flight, if any; returns its error line (None: written),
        which is then cleared."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self.error = self.error, None
        return error

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


def _buffer_key(part: Part) -> tuple[str, tuple[int, ...]]:
    """Where a part's staged copy is kept between saves: its tensor and its box."""
    return part.key, part.offsets


def empty_folder(folder: Path) -> None:
    """Make ``folder`` an empty folder: what it holds is removed (links, FIFOs and devices
    are unlinked, never opened nor followed); a file or a link in its place is replaced."""
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        folder.mkdir(parents=True, exist_ok=True)
        return
    if not stat.S_ISDIR(st.st_mode):
        folder.unlink()
        folder.mkdir(parents=True, exist_ok=True)
        return
    for entry in os.scandir(folder):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)
