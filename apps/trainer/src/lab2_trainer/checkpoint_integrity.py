"""Checksums of a checkpoint's contents, and the checks a loaded checkpoint must pass.

``torch.save`` writes a zip archive whose per-record CRCs ``torch.load`` never verifies,
so bytes flipped inside a tensor's payload load silently. A checkpoint therefore carries
``checksums``: a CRC-32 of every tensor's bytes, keyed by the tensor's path in the
checkpoint (``model/tok_emb.weight``, ``optimizer/state/3/exp_avg``), plus one of
everything else (``_meta``: settings, step, sampler position, ...). On load the first
tensor whose bytes no longer match is named; then every floating-point tensor of the
model and of the optimizer state must be finite.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any

import torch

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
