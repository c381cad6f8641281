"""Single-file checkpoints: written atomically, read back with every field and every
tensor checked.

A run saves sharded checkpoints (:mod:`lab2_trainer.checkpoint.folders`); this format is
what ``lab2-train export`` writes from one, what earlier versions saved, and what
``--resume`` also takes. The small state of a sharded checkpoint (its ``trainer.pt``) is
this format without the model and the optimizer's tensors (``sharded: True``).

A single-file checkpoint is one ``torch.save`` file holding only tensors and plain Python
values (so it loads with ``weights_only=True``):

* ``format``/``version``: what this file is;
* ``model_config``: the model's fields; ``model``: its state dict;
* ``optimizer``: the whole optimizer state in ``torch.optim.AdamW``'s format (a sharded
  optimizer is consolidated first), so any sharding and any number of ranks can load it;
* ``schedule``, ``step``, ``settings`` (the training settings), ``sampler`` (the data
  position), ``data`` (what data it was trained on), ``rng`` (rank 0's random states;
  ``rng_by_rank``, every rank's: :mod:`lab2_trainer.checkpoint.rng`),
  ``scaler`` (fp16 gradient scaler), ``world_size``;
* ``checksums`` (version 2), verified on load, where the model and the optimizer state
  must also be finite. Version 1 files (no checksums) still load, with the finiteness
  check only.

**Integrity.** ``torch.save`` writes a zip archive whose per-record CRCs ``torch.load``
never verifies, so bytes flipped inside a tensor's payload load silently. A checkpoint
therefore carries ``checksums``: a CRC-32 of every tensor's bytes, keyed by the tensor's
path in the checkpoint (``model/tok_emb.weight``, ``optimizer/state/3/exp_avg``), plus one
of everything else (``_meta``: settings, step, sampler position, ...). On load the first
tensor whose bytes no longer match is named (:func:`first_damage`); then every
floating-point tensor of the model and of the optimizer state must be finite
(:func:`first_non_finite`).
"""

from __future__ import annotations

import os
import stat
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lab2_trainer.config import UsageError
from lab2_trainer.runtime.run_folder import atomic_write

FORMAT = "lab2-trainer-checkpoint"
VERSION = 2
READABLE_VERSIONS = (1, 2)
CHECKPOINT_NAME = "ckpt.pt"
REQUIRED_KEYS = ("model_config", "model", "optimizer", "schedule", "step", "settings",
                 "sampler", "data", "rng")


def save_atomic(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to a temporary file beside ``path``, flush it to disk, then rename it
    over ``path``: a reader (or a crash) never sees a half-written checkpoint.

    Args:
        obj: what to save.
        path: destination; its folder must exist.
    """
    path = Path(path)
    if isinstance(obj, dict) and obj.get("format") == FORMAT:
        obj = seal(obj)
    atomic_write(path, lambda f: _save_interruptible(obj, f))


def _save_interruptible(obj: Any, f: Any) -> None:
    """``torch.save``, except that Ctrl-C or SIGTERM arriving inside torch's zip writer
    stops the run as an interrupt: the writer turns it into ``RuntimeError('unexpected
    pos ...')`` with the interrupt as its context, which would read as a failed rank."""
    try:
        torch.save(obj, f)
    except RuntimeError as err:
        if isinstance(err.__context__, KeyboardInterrupt):
            raise err.__context__ from None
        raise


def resolve_checkpoint_path(path: str | os.PathLike) -> Path:
    """A single-file checkpoint, or a run folder holding ``ckpt.pt``."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / CHECKPOINT_NAME
    if not p.is_file():
        raise UsageError(f"checkpoint not found: {p}")
    return p


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read and check a single-file checkpoint.

    Raises:
        UsageError: missing, unreadable, truncated, not ours, from another version,
            damaged (a tensor that does not match its checksum: the first is named), or
            holding NaN or infinity in the model or the optimizer state.
    """
    return read_sealed(resolve_checkpoint_path(path))


#: What the small state of a sharded checkpoint (its ``trainer.pt``) holds: a
#: single-file checkpoint's fields but the model's and the optimizer's tensors.
SHARDED_REQUIRED_KEYS = tuple(k for k in REQUIRED_KEYS if k not in ("model", "optimizer")) \
    + ("optimizer_groups",)


def read_sealed(p: Path, *, shards: bool = False) -> dict[str, Any]:
    """Read and check a sealed file: a single-file checkpoint, or with ``shards`` the
    ``trainer.pt`` of a sharded one (see :mod:`lab2_trainer.checkpoint.folders`)."""
    head = _head(p)
    if not head.startswith(TORCH_SAVE_STARTS):
        what = "it is empty" if not head else f"it starts with {head!r}"
        raise UsageError(f"cannot read checkpoint {p}: not a lab2-trainer checkpoint ({what}; "
                         "torch.save writes a zip archive)")
    try:
        with warnings.catch_warnings():
            # torch warns about what it is about to refuse (a plain pickle's protocol):
            # the one line below says it.
            warnings.simplefilter("ignore")
            ckpt = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 (a damaged file can fail in any way inside torch)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if reason.startswith("Weights only load failed"):  # a pickle of other objects
            reason = ("it holds Python objects beyond tensors and plain values, which a "
                      "checkpoint never does (not a lab2-trainer checkpoint)")
        raise UsageError(f"cannot read checkpoint {p}: {reason}") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise UsageError(f"{p} is not a lab2-trainer checkpoint")
    if ckpt.get("version") not in READABLE_VERSIONS:
        raise UsageError(
            f"{p} is checkpoint version {ckpt.get('version')}; this trainer reads "
            f"{', '.join(map(str, READABLE_VERSIONS))}"
        )
    if bool(ckpt.get("sharded")) != shards:
        raise UsageError(f"{p} is the small state of a sharded checkpoint: resume from its "
                         "folder" if not shards else f"{p} is not a sharded checkpoint's state")
    if ckpt["version"] >= 2:
        damage = first_damage(ckpt)
        if damage:
            raise UsageError(f"checkpoint {p} is damaged: {damage}")
    missing = [k for k in (SHARDED_REQUIRED_KEYS if shards else REQUIRED_KEYS) if k not in ckpt]
    if missing:
        raise UsageError(f"checkpoint {p} lacks {', '.join(missing)}")
    bad = first_non_finite(ckpt)
    if bad:
        raise UsageError(f"checkpoint {p} is unusable: {bad}")
    return ckpt


#: How a file ``torch.save`` wrote starts: a zip archive's first record, or (the legacy
#: format, and plain pickles, which the load then names) a pickle's protocol opcode.
TORCH_SAVE_STARTS = (b"PK\x03\x04", b"\x80")


def _head(p: Path) -> bytes:
    """The first 4 bytes of the regular file ``p`` (opened without blocking)."""
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise UsageError(f"cannot read checkpoint {p}: {exc.strerror or exc}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UsageError(f"cannot read checkpoint {p}: not a regular file")
        return os.read(fd, 4)
    except OSError as exc:
        raise UsageError(f"cannot read checkpoint {p}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- integrity
META = "_meta"
CHECKSUMS = "checksums"
# Where non-finite values mean a broken run (rng, scaler and the rest are not weights).
FINITE_SECTIONS = ("model", "optimizer")


def _walk(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(path, leaf) for every leaf of nested dicts, lists and tuples, in order."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _walk(item, f"{path}/{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _walk(item, f"{path}/{i}")
    else:
        yield path, value


def tensor_crc(t: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes (any dtype, any layout; copied to the CPU if needed)."""
    flat = t.detach().reshape(-1).contiguous().cpu()
    if flat.numel() == 0:
        return 0
    return zlib.crc32(flat.view(torch.uint8).numpy().data)


def _meta_crc(ckpt: dict[str, Any]) -> int:
    leaves = [(p, v if not isinstance(v, torch.Tensor) else ("tensor", str(v.dtype),
                                                            tuple(v.shape)))
              for p, v in _walk({k: v for k, v in ckpt.items() if k != CHECKSUMS}, "")]
    return zlib.crc32(repr(leaves).encode())


def checksums(ckpt: dict[str, Any]) -> dict[str, int]:
    """The ``checksums`` entry for ``ckpt`` (which must not hold one yet)."""
    out = {path: tensor_crc(v) for path, v in _walk(ckpt, "") if isinstance(v, torch.Tensor)}
    out[META] = _meta_crc(ckpt)
    return out


def seal(ckpt: dict[str, Any]) -> dict[str, Any]:
    """A shallow copy of ``ckpt`` with its checksums."""
    body = {k: v for k, v in ckpt.items() if k != CHECKSUMS}
    return {**body, CHECKSUMS: checksums(body)}


def first_damage(ckpt: dict[str, Any]) -> str | None:
    """What does not match its checksum first (None when everything does)."""
    stored = ckpt.get(CHECKSUMS)
    if not isinstance(stored, dict):
        return "its checksums are missing"
    seen = set()
    for path, value in _walk({k: v for k, v in ckpt.items() if k != CHECKSUMS}, ""):
        if not isinstance(value, torch.Tensor):
            continue
        seen.add(path)
        if path not in stored:
            return f"tensor {path} has no checksum"
        got, saved = tensor_crc(value), stored[path]
        if got != saved:
            saved_text = f"{saved:08x}" if isinstance(saved, int) else repr(saved)
            return (f"tensor {path} does not match its checksum (crc32 {got:08x}, "
                    f"saved {saved_text})")
    lost = sorted(set(stored) - seen - {META})
    if lost:
        return f"tensor {lost[0]} is missing"
    if stored.get(META) != _meta_crc(ckpt):
        return "its settings and counters do not match their checksum"
    return None


def first_non_finite(ckpt: dict[str, Any]) -> str | None:
    """The first model or optimizer tensor holding NaN or infinity, described."""
    for section in FINITE_SECTIONS:
        for path, value in _walk(ckpt.get(section), section):
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                bad = ~torch.isfinite(value)
                if bool(bad.any()):
                    n = int(bad.sum())
                    return f"tensor {path} holds {n} non-finite value{'s' if n > 1 else ''}"
    return None
