"""Sharded checkpoints on disk: one folder per saved step, a manifest written last.

A run keeps its checkpoints under ``<out>/ckpt/``, one folder per saved step
(``step-000100/``), each holding:

* what ``torch.distributed.checkpoint`` wrote: one ``__<rank>_<n>.distcp`` file per
  writing rank and ``.metadata`` (which boxes of which tensors are where);
* ``trainer.pt``: the run's small state, the fields of a single-file checkpoint
  (:mod:`lab2_trainer.checkpoint.single_file`) but the tensors of the model and of the optimizer
  (``step``, ``settings``, ``sampler``, ``rng``, ``optimizer_groups``, ...), sealed with
  its own checksums;
* ``manifest.json``, written last and atomically by rank 0 once every rank's files are
  on disk: the size and CRC-32 of every other file. **A folder without a valid manifest
  is not a checkpoint** (an interrupted write, a ``kill -9``): :func:`newest_step` skips
  it (:func:`incomplete_steps` says why), and :func:`verify` refuses a folder whose files
  do not match it (missing, truncated, corrupt), or that holds a file a load would read
  (``*.distcp``, ``*.metadata``, ``trainer.pt``) which the manifest does not list, or
  whose ``.metadata`` points a load at a file the manifest does not list: every byte a
  load reads is checked.

A step folder that is not a complete checkpoint is never overwritten or removed unsaid:
:func:`step_folder_notes` sets it aside (``step-N.partial-<time>``,
``step-N.unreadable-<time>``) or names it, before a run writes anything.

Files are opened without blocking and read only when regular
(:func:`lab2_trainer.runtime.paths.open_regular`): a FIFO or a device named like a
checkpoint's file never holds a run. What the ``.distcp`` files hold, and how, is
:mod:`lab2_trainer.checkpoint.parts`; the export to one file is
:mod:`lab2_trainer.checkpoint.export`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import torch

from lab2_trainer.checkpoint.parts import dcp_metadata, full_tensors, saved_tensors
from lab2_trainer.config import UsageError
from lab2_trainer.runtime.paths import file_kind, open_regular
from lab2_trainer.runtime.run_folder import atomic_write_text

CKPT_DIR = "ckpt"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer.pt"
FORMAT = "lab2-trainer-sharded-checkpoint"
#: The manifest version written: 2, each tensor stored in its whole shape (1: as its flat
#: view; :mod:`lab2_trainer.checkpoint.compat` says what reads what).
VERSION = 2
#: The manifest versions read.
READS = (1, 2)
STEP_FOLDER = re.compile(r"^step-(\d+)$")
#: The largest manifest read (one is a few hundred bytes per file listed).
MANIFEST_MAX_BYTES = 16 << 20


def step_folder(root: str | os.PathLike, step: int) -> Path:
    """``<root>/step-<step, 6 digits or more>``."""
    return Path(root) / f"step-{step:06d}"


def file_crc(path: str | os.PathLike, block: int = 1 << 24) -> tuple[int, int]:
    """(bytes, CRC-32) of a regular file, read in blocks (:func:`open_regular`)."""
    crc, size = 0, 0
    with open_regular(path) as f:
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
    body, problem = _manifest(folder)
    if problem is not None:
        raise UsageError(f"checkpoint {folder} cannot be used: {problem}")
    if body is None:
        raise UsageError(f"{folder} has no {MANIFEST}: not a complete checkpoint (an "
                         "interrupted write leaves none)")
    return body


def _manifest(folder: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(the manifest, None), or (None, what is wrong with it), or (None, None) when there
    is none (an interrupted write)."""
    path = folder / MANIFEST
    try:
        kind = file_kind(os.stat(path).st_mode)
    except FileNotFoundError:
        if os.path.islink(path):
            return None, f"its {MANIFEST} is a symbolic link to nothing"
        return None, None
    except OSError as exc:
        return None, f"its {MANIFEST} cannot be examined ({exc.strerror or exc})"
    if kind is not None:
        return None, f"its {MANIFEST} is {kind}, not a regular file"
    try:
        with open_regular(path) as f:
            data = f.read(MANIFEST_MAX_BYTES + 1)
    except OSError as exc:
        return None, f"its {MANIFEST} cannot be read ({exc.strerror or exc})"
    if len(data) > MANIFEST_MAX_BYTES:
        return None, f"its {MANIFEST} is over {MANIFEST_MAX_BYTES:,} bytes"
    try:
        body = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        return None, f"its {MANIFEST} is not valid JSON: {exc}"
    files = body.get("files") if isinstance(body, dict) else None
    if (not isinstance(body, dict) or body.get("format") != FORMAT
            or not isinstance(files, dict)
            or not all(isinstance(v, dict) and isinstance(v.get("bytes"), int)
                       and isinstance(v.get("crc32"), str) for v in files.values())):
        return None, f"its {MANIFEST} is not a lab2-trainer checkpoint manifest"
    version = body.get("version")
    if isinstance(version, bool) or version not in READS:
        return None, (f"its {MANIFEST} is manifest version {body.get('version')}; this "
                      f"trainer reads {' and '.join(map(str, READS))}")
    return body, None


def read_by_load(name: str) -> bool:
    """Whether a load may read the file ``name`` of a step folder: DCP's shards and
    metadata, and the small state. Each must be listed in the manifest (and so checked)."""
    return name.endswith((".distcp", ".metadata")) or name == TRAINER_STATE


def _file_problem(folder: Path, name: str, entry: dict[str, Any]) -> str | None:
    path = folder / name
    if os.sep in name or name in ("", ".", "..") or not path.is_file():
        return f"file {name} is missing"
    size = path.stat().st_size
    if size != entry["bytes"]:
        return (f"file {name} is {'truncated' if size < entry['bytes'] else 'longer'} "
                f"({size:,} bytes, the manifest says {entry['bytes']:,})")
    try:
        _, crc = file_crc(path)
    except OSError as exc:  # swapped for a FIFO since the check above, or unreadable
        return f"file {name} cannot be read ({exc.strerror or exc})"
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
    # What the folder holds for a load to read is exactly what the manifest lists: a file
    # it does not list would be read unchecked (any kind of file: a FIFO is named, never
    # opened).
    try:
        present = sorted(e.name for e in os.scandir(folder) if read_by_load(e.name))
    except OSError as exc:
        raise UsageError(f"cannot list checkpoint {folder}: {exc.strerror or exc}") from None
    unlisted = [n for n in present if n not in body["files"]]
    if unlisted:
        more = f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else ""
        raise UsageError(f"checkpoint {folder} is damaged: file {unlisted[0]}{more} is not in "
                         "its manifest, so a load would read it unchecked")
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(names)))) as pool:
        problems = list(pool.map(lambda n: _file_problem(folder, n, body["files"][n]), names))
    for problem in problems:
        if problem:
            raise UsageError(f"checkpoint {folder} is damaged: {problem}")
    # The files DCP opens are those its (now checked) metadata names.
    storage = getattr(dcp_metadata(folder), "storage_data", None)
    if not isinstance(storage, dict):
        raise UsageError(f"checkpoint {folder} is damaged: its .metadata says where no "
                         "tensor is stored")
    named = sorted({str(getattr(info, "relative_path", "")) for info in storage.values()})
    outside = [n for n in named if n not in body["files"]]
    if outside:
        raise UsageError(f"checkpoint {folder} is damaged: its .metadata reads tensors from "
                         f"{outside[0]!r}, which its manifest does not list")
    return body


def complete_steps(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every step folder under ``root`` with a readable manifest, oldest
    first (the files are not checked here: :func:`verify` does)."""
    return sorted((step, folder) for step, folder in _step_folders(root)
                  if _manifest(folder)[0] is not None)


def _step_folders(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every folder named ``step-N`` under ``root``."""
    found = []
    if not root.is_dir():
        return found
    for entry in root.iterdir():
        match = STEP_FOLDER.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return found


class Incomplete(NamedTuple):
    """A step folder that is not a complete checkpoint."""

    step: int
    folder: Path
    why: str
    """In words: an interrupted write, or what is wrong with its manifest."""
    interrupted: bool
    """It has no manifest: an interrupted write (a kill during a save). Otherwise its
    manifest is there but unreadable, and its other files may well be intact."""


def incomplete_steps(root: Path) -> list[Incomplete]:
    """Every step folder under ``root`` that :func:`newest_step` skips, oldest first, with
    why."""
    found = []
    for step, folder in sorted(_step_folders(root)):
        body, problem = _manifest(folder)
        if body is None:
            found.append(Incomplete(step, folder, problem or f"an interrupted write: no "
                                    f"{MANIFEST}", problem is None))
    return found


def set_aside(item: Incomplete) -> Path:
    """Rename an incomplete step folder to ``step-N.partial-<time>`` (an interrupted write)
    or ``step-N.unreadable-<time>`` beside it, a name no run reads or removes; returns the
    new path."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = f"{item.folder.name}.{'partial' if item.interrupted else 'unreadable'}-{stamp}"
    target = item.folder.with_name(base)
    n = 1
    while os.path.lexists(target):
        n += 1
        target = item.folder.with_name(f"{base}-{n}")
    os.rename(item.folder, target)
    return target


def step_folder_notes(settings) -> list[str]:
    """Deal with the step folders that are not complete checkpoints (no valid manifest)
    which this run meets, before it writes any; returns a line for each:

    * in ``--out``'s ``ckpt/``, one whose manifest is there but unreadable (its shards may
      be intact) is set aside as ``step-N.unreadable-<time>``, so that the run neither
      overwrites it (a save of that step) nor removes it (``--keep-last``);
    * there too, on a fresh start, an interrupted write's (no manifest) is set aside as
      ``step-N.partial-<time>``;
    * a resume names each one newer than its step, which it passed over (an interrupted
      write there is replaced when the run saves that step again);

    and one line when ``--out`` holds complete checkpoints newer than the step folder resumed
    from, which the run's first save removes (:func:`prune`).

    Raises:
        UsageError: a folder cannot be renamed.
    """
    out_root = Path(settings.out) / CKPT_DIR
    resumed = Path(settings.resume) if settings.resume is not None else None
    match = STEP_FOLDER.match(resumed.name) if resumed is not None and resumed.is_dir() else None
    same_root = match is not None and os.path.realpath(resumed.parent) == os.path.realpath(
        out_root)
    notes = []
    if match is not None and not same_root:  # nothing is written there: named only
        notes += [f"passed over {item.folder} ({item.why}); resuming from {resumed}"
                  for item in incomplete_steps(resumed.parent) if item.step > int(match[1])]
    for item in incomplete_steps(out_root):
        passed = same_root and item.step > int(match[1])
        if item.interrupted and resumed is not None:
            if passed:
                notes.append(f"passed over {item.folder} ({item.why}); resuming from {resumed}")
            continue
        try:
            aside = set_aside(item)
        except OSError as exc:
            raise UsageError(f"cannot set aside {item.folder} ({item.why}): "
                             f"{exc.strerror or exc}") from None
        if passed:
            notes.append(f"passed over {item.folder} ({item.why}); set it aside as "
                         f"{aside.name}, so that this run does not overwrite it; resuming "
                         f"from {resumed}")
        elif item.interrupted:
            notes.append(f"set aside {item.folder} ({item.why}) as {aside.name}: no complete "
                         "checkpoint there, so this run starts afresh")
        else:
            notes.append(f"set aside {item.folder} ({item.why}) as {aside.name}, so that "
                         "this run does not overwrite or remove it")
    newer = [folder.name for n, folder in complete_steps(out_root)
             if match is not None and n > int(match[1])]
    if newer:
        notes.append(f"resuming from {resumed} while {out_root} holds newer checkpoints "
                     f"({', '.join(newer)}): this run's first save supersedes them (they "
                     "are removed then, and --keep-last counts this run's checkpoints only)")
    return notes


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
                found = incomplete_steps(root)
                last = f"; {found[-1].folder.name}: {found[-1].why}" if found else ""
                raise UsageError(f"{root} holds no complete checkpoint (no step folder with "
                                 f"a valid {MANIFEST}{last}): a run there without --resume "
                                 "starts afresh, setting it aside")
            return newest
    if (p / CHECKPOINT_NAME).is_file():
        return p / CHECKPOINT_NAME
    raise UsageError(f"checkpoint not found: {p} holds no {CKPT_DIR}/step-N folder")


def has_checkpoint(run: str | os.PathLike) -> bool:
    """Whether a run folder holds a complete checkpoint of either format (step folders
    without a valid manifest do not count: :func:`incomplete_steps`)."""
    from lab2_trainer.checkpoint.single_file import CHECKPOINT_NAME

    run = Path(run)
    return (run / CHECKPOINT_NAME).exists() or newest_step(run / CKPT_DIR) is not None


def prune(root: Path, keep_last: int, newest: int) -> list[str]:
    """After step ``newest`` was completed by the run saving into ``root``: remove

    * the complete step folders newer than ``newest``: a run's steps only grow, so they are
      from a timeline it does not continue (it resumed from an older step), which its save
      supersedes; left there, ``--resume`` of the run would take the newest of them;
    * of the others, those beyond the ``keep_last`` newest (0 keeps all): ``newest`` is
      the newest kept, and the folder the run resumed from goes only once ``keep_last``
      newer ones of its own are complete;
    * incomplete ones older than ``newest`` (left by interrupted writes).

    Nothing complete is removed unless step ``newest`` is itself complete. Returns the
    names removed."""
    removed = []
    complete = complete_steps(root)
    kept = {folder for _, folder in complete}
    if newest not in {n for n, _ in complete}:
        complete = []  # no good save to stand for them: every checkpoint stays
    superseded = [folder for n, folder in complete if n > newest]
    timeline = [folder for n, folder in complete if n <= newest]
    drop = superseded + (timeline[:-keep_last] if keep_last > 0 else [])
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
    from lab2_trainer.checkpoint.rng import rng_state
    from lab2_trainer.checkpoint.single_file import FORMAT as FILE_FORMAT
    from lab2_trainer.checkpoint.single_file import VERSION as FILE_VERSION
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
        bad = non_finite(full_tensors(folder, batch))
        if bad:
            return bad
        batch, size = [], 0
    return None


def non_finite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The first of ``tensors`` (by name) holding NaN or infinity, described."""
    for name in sorted(tensors):
        t = tensors[name]
        if t.is_floating_point():
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                return f"tensor {name} holds {bad} non-finite value{'s' if bad > 1 else ''}"
    return None


