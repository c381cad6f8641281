"""Sharded checkpoints on disk: one folder per saved step, a manifest written last.

A run keeps its checkpoints under ``<out>/ckpt/``, one folder per saved step
(``step-000100/``), each holding:

* what ``torch.distributed.checkpoint`` wrote: one ``__<rank>_<n>.distcp`` file per
  writing rank and ``.metadata`` (which ranges of which tensors are where);
* ``trainer.pt``: the run's small state, the fields of a single-file checkpoint
  (:mod:`lab2_trainer.checkpoint.single_file`) but the tensors of the model and of the optimizer
  (``step``, ``settings``, ``sampler``, ``rng``, ``optimizer_groups``, ...), sealed with
  its own checksums;
* ``manifest.json``, written last and atomically by rank 0 once every rank's files are
  on disk: the size and CRC-32 of every other file. **A folder without a valid manifest
  is not a checkpoint** (an interrupted write, a ``kill -9``): :func:`newest_step` skips
  it, and :func:`verify` refuses a folder whose files do not match it (missing,
  truncated, corrupt).

What the ``.distcp`` files hold, and how, is :mod:`lab2_trainer.checkpoint.parts`; the export
to one file is :mod:`lab2_trainer.checkpoint.export`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from lab2_trainer.config import UsageError
from lab2_trainer.runtime.run_folder import atomic_write_text

CKPT_DIR = "ckpt"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer.pt"
FORMAT = "lab2-trainer-sharded-checkpoint"
VERSION = 1
STEP_FOLDER = re.compile(r"^step-(\d+)$")


def step_folder(root: str | os.PathLike, step: int) -> Path:
    """``<root>/step-<step, 6 digits or more>``."""
    return Path(root) / f"step-{step:06d}"


def file_crc(path: str | os.PathLike, block: int = 1 << 24) -> tuple[int, int]:
    """(bytes, CRC-32) of a file, read in blocks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(block):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


def write_manifest(folder: Path, step: int, files: dict[str, tuple[int, int]],
                   **extra: Any) -> None:
    """The manifest, atomically: ``files`` maps each file's name to (bytes, CRC-32)."""
    body = {"format": FORMAT, "version": VERSION, "step": step, **extra,
            "files": {name: {"bytes": size, "crc32": f"{crc:08x}"}
                      for name, (size, crc) in sorted(files.items())}}
    atomic_write_text(folder / MANIFEST, json.dumps(body, indent=1) + "\n")


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of a step folder, checked for form (not against the files).

    Raises:
        UsageError: none, unreadable, or not ours.
    """
    path = folder / MANIFEST
    if not path.is_file():
        raise UsageError(f"{folder} has no {MANIFEST}: not a complete checkpoint (an "
                         "interrupted write leaves none)")
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UsageError(f"cannot read {path}: {exc}") from None
    files = body.get("files") if isinstance(body, dict) else None
    if (not isinstance(body, dict) or body.get("format") != FORMAT
            or not isinstance(files, dict)
            or not all(isinstance(v, dict) and isinstance(v.get("bytes"), int)
                       and isinstance(v.get("crc32"), str) for v in files.values())):
        raise UsageError(f"{path} is not a lab2-trainer checkpoint manifest")
    if body.get("version") != VERSION:
        raise UsageError(f"{path} is manifest version {body.get('version')}; this trainer "
                         f"reads {VERSION}")
    return body


def _file_problem(folder: Path, name: str, entry: dict[str, Any]) -> str | None:
    path = folder / name
    if os.sep in name or name in ("", ".", "..") or not path.is_file():
        return f"file {name} is missing"
    size = path.stat().st_size
    if size != entry["bytes"]:
        return (f"file {name} is {'truncated' if size < entry['bytes'] else 'longer'} "
                f"({size:,} bytes, the manifest says {entry['bytes']:,})")
    _, crc = file_crc(path)
    if f"{crc:08x}" != entry["crc32"]:
        return f"file {name} does not match its checksum (crc32 {crc:08x}, saved {entry['crc32']})"
    return None


def verify(folder: Path) -> dict[str, Any]:
    """Check every file of a step folder against its manifest (the files in parallel);
    returns the manifest.

    Raises:
        UsageError: one line naming the folder and the first file missing, truncated or
            corrupt.
    """
    body = read_manifest(folder)
    names = sorted(body["files"])
    for required in (TRAINER_STATE, ".metadata"):
        if required not in names:
            raise UsageError(f"checkpoint {folder} is damaged: its manifest lists no {required}")
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(names)))) as pool:
        problems = list(pool.map(lambda n: _file_problem(folder, n, body["files"][n]), names))
    for problem in problems:
        if problem:
            raise UsageError(f"checkpoint {folder} is damaged: {problem}")
    return body


def complete_steps(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every step folder under ``root`` with a readable manifest, oldest
    first (the files are not checked here: :func:`verify` does)."""
    found = []
    if not root.is_dir():
        return found
    for entry in root.iterdir():
        match = STEP_FOLDER.match(entry.name)
        if match and entry.is_dir() and (entry / MANIFEST).is_file():
            try:
                read_manifest(entry)
            except UsageError:
                continue
            found.append((int(match.group(1)), entry))
    return sorted(found)


def newest_step(root: Path) -> Path | None:
    """The newest complete step folder under ``root`` (None when there is none)."""
    steps = complete_steps(root)
    return steps[-1][1] if steps else None


def is_checkpoint_root(path: Path) -> bool:
    return path.is_dir() and any(STEP_FOLDER.match(p.name) for p in path.iterdir())


def resolve(path: str | os.PathLike) -> Path:
    """What ``--resume PATH`` names: a single-file checkpoint, a step folder, a run's
    ``ckpt/`` folder or a run folder (the newest complete step in either), or a run
    folder of an earlier version holding ``ckpt.pt``.

    Raises:
        UsageError: nothing there, or no complete checkpoint.
    """
    from lab2_trainer.checkpoint.single_file import CHECKPOINT_NAME

    p = Path(path).expanduser()
    if p.is_file():
        return p
    if not p.is_dir():
        raise UsageError(f"checkpoint not found: {p}")
    if STEP_FOLDER.match(p.name) or (p / MANIFEST).exists():
        return p
    for root in (p / CKPT_DIR, p):
        if is_checkpoint_root(root):
            newest = newest_step(root)
            if newest is None:
                raise UsageError(f"{root} holds no complete checkpoint (no step folder with "
                                 f"a valid {MANIFEST})")
            return newest
    if (p / CHECKPOINT_NAME).is_file():
        return p / CHECKPOINT_NAME
    raise UsageError(f"checkpoint not found: {p} holds no {CKPT_DIR}/step-N folder")


def has_checkpoint(run: str | os.PathLike) -> bool:
    """Whether a run folder holds a checkpoint (complete or not) of either format."""
    from lab2_trainer.checkpoint.single_file import CHECKPOINT_NAME

    run = Path(run)
    return (run / CHECKPOINT_NAME).exists() or is_checkpoint_root(run / CKPT_DIR)


def prune(root: Path, keep_last: int, newest: int) -> list[str]:
    """After step ``newest`` was completed: remove the complete step folders beyond the
    ``keep_last`` newest (0 keeps all), and incomplete ones older than ``newest`` (left
    by interrupted writes). Returns the names removed."""
    removed = []
    complete = complete_steps(root)
    drop = [folder for _, folder in complete[:-keep_last]] if keep_last > 0 else []
    kept = {folder for _, folder in complete}
    for entry in root.iterdir() if root.is_dir() else ():
        match = STEP_FOLDER.match(entry.name)
        if match and entry not in kept and int(match.group(1)) < newest:
            drop.append(entry)
    for folder in drop:
        # The manifest first: a folder half removed is never taken for a checkpoint.
        (folder / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder.name)
    return removed


# --------------------------------------------------------------------- the small state
def save_trainer_state(folder: Path, state: dict[str, Any]) -> tuple[int, int]:
    """``trainer.pt``, sealed and written atomically; returns its (bytes, CRC-32)."""
    from lab2_trainer.checkpoint.single_file import save_atomic

    save_atomic(state, folder / TRAINER_STATE)
    return file_crc(folder / TRAINER_STATE)


def trainer_state(trainer: Any) -> dict[str, Any]:
    """What ``trainer.pt`` holds of a :class:`lab2_trainer.training.loop.Trainer` (rank 0's)."""
    from lab2_trainer.checkpoint.single_file import FORMAT as FILE_FORMAT
    from lab2_trainer.checkpoint.single_file import VERSION as FILE_VERSION
    from lab2_trainer.checkpoint.single_file import rng_state
    from zero1.checkpoint import pack_param_groups

    return {
        "format": FILE_FORMAT,
        "version": FILE_VERSION,
        "sharded": True,
        "model_config": trainer.s.model.to_dict(),
        "optimizer_groups": pack_param_groups(trainer.optimizer.param_groups),
        "schedule": trainer.schedule.state_dict(),
        "step": trainer.step,
        "settings": trainer.s.to_dict(),
        "sampler": trainer.batches.state_dict(),
        "data": trainer.corpus.identity(),
        "rng": rng_state(trainer.ctx.device),
        "scaler": trainer.scaler.state_dict() if trainer.scaler is not None else None,
        "world_size": trainer.ctx.world_size,
        # The learned bucket order (minddp's, or zero1's): a resumed run at this world
        # size then sums every gradient in the same order, bit for bit (None: nothing).
        "gradient_order": trainer.parallel.gradient_order,
    }


def load_trainer_state(folder: Path) -> dict[str, Any]:
    """``trainer.pt`` of a step folder, read and checked as a single-file checkpoint is
    (format, version, checksums), less the tensors of the model and the optimizer."""
    from lab2_trainer.checkpoint.single_file import read_sealed

    return read_sealed(folder / TRAINER_STATE, shards=True)


def first_non_finite(folder: Path, budget: int = 1 << 28) -> str | None:
    """The first floating tensor of a step folder holding NaN or infinity, described
    (None when all are finite). Read a few at a time (``budget`` bytes), never all."""
    from lab2_trainer.checkpoint.parts import full_tensors, saved_tensors

    meta = saved_tensors(folder)
    batch: list[str] = []
    size = 0
    keys = sorted(k for k, md in meta.items() if hasattr(md, "size"))
    for i, key in enumerate(keys):
        md = meta[key]
        batch.append(key)
        size += int(md.size.numel()) * md.properties.dtype.itemsize
        if size < budget and i + 1 < len(keys):
            continue
        for name, t in full_tensors(folder, batch).items():
            if t.is_floating_point():
                bad = int((~torch.isfinite(t)).sum())
                if bad:
                    return f"tensor {name} holds {bad} non-finite value{'s' if bad > 1 else ''}"
        batch, size = [], 0
    return None


