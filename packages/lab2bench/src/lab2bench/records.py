"""Measurements on disk: one JSON line each, and atomic file writes (``atomic_write``,
``atomic_write_bytes``, ``atomic_write_text`` and ``temp_file_beside``: :mod:`lab2sys.files`'
functions, under the names lab2bench has always offered them by)."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import uuid
import warnings
from pathlib import Path
from typing import Any

from lab2bench.env import env_info
from lab2sys.files import atomic_write as atomic_write
from lab2sys.files import atomic_write_bytes as atomic_write_bytes
from lab2sys.files import atomic_write_text as atomic_write_text
from lab2sys.files import temp_file_beside as temp_file_beside


def to_jsonable(obj: Any) -> Any:
    """Make ``obj`` JSON-ready: dataclass-like objects with ``to_dict``, torch dtypes and
    devices, paths, numpy and torch scalars; NaN and infinities become None."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in obj]
    if hasattr(obj, "to_dict") and callable(obj.to_dict):
        return to_jsonable(obj.to_dict())
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    # Tensors and numpy arrays (and their scalars), then other scalar wrappers.
    for method in (getattr(obj, "tolist", None), getattr(obj, "item", None)):
        if callable(method):
            with contextlib.suppress(TypeError, ValueError, RuntimeError):
                return to_jsonable(method())
    return str(obj)  # torch.dtype, torch.device and anything else: readable text


class Recorder:
    """Appends one JSON line per measurement to a file.

    Each line is ``{"suite", "run_id", "timestamp", "config", "metrics", "env"}``:
    ``config`` says what was measured, ``metrics`` what came out, ``env`` where
    (``env_info()``: device, versions, git commit, host). Lines are appended and
    flushed one by one, so a run that dies keeps what it measured.

    Args:
        path: the JSONL file (created with its folders; appended to if it exists).
        run_id: tag shared by this run's lines (default: a fresh random id).
        env: the environment dict stored on each line (default: ``env_info()``
            computed once, on the first record).
    """

    def __init__(self, path: str | os.PathLike[str], *, run_id: str | None = None,
                 env: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self._env = env

    @property
    def env(self) -> dict[str, Any]:
        if self._env is None:
            self._env = env_info()
        return self._env

    def record(self, suite: str, config: dict[str, Any], metrics: dict[str, Any]) -> dict[str, Any]:
        """Append one measurement and return the dict written.

        Args:
            suite: the benchmark's name (``"norm"``, ``"comm"``, ...).
            config: what was measured (shape, dtype, implementation...).
            metrics: the results (times, bandwidths, statuses...).
        """
        if not isinstance(suite, str) or not suite:
            raise ValueError(f"suite must be a non-empty string, got {suite!r}")
        if not isinstance(config, dict) or not isinstance(metrics, dict):
            raise TypeError("config and metrics must be dicts")
        now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")  # ISO 8601
        rec = to_jsonable({"suite": suite, "run_id": self.run_id, "timestamp": now,
                           "config": config, "metrics": metrics, "env": self.env})
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec, allow_nan=False) + "\n")
        return rec


def read_records(path: str | os.PathLike[str], *, suite: str | None = None,
                 run_id: str | None = None) -> list[dict[str, Any]]:
    """Read a JSONL file written by ``Recorder``.

    A last line cut short (a run killed mid-write) is skipped with a warning; a bad
    line elsewhere raises ``ValueError`` naming its line number.

    Args:
        path: the file.
        suite: keep only records of this suite.
        run_id: keep only records of this run.
    """
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    out: list[dict[str, Any]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):
                warnings.warn(f"{path}: last line {number} is incomplete, skipped", stacklevel=2)
                continue
            raise ValueError(f"{path}: line {number} is not valid JSON: {err}") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path}: line {number} is not a JSON object")
        if suite is not None and rec.get("suite") != suite:
            continue
        if run_id is not None and rec.get("run_id") != run_id:
            continue
        out.append(rec)
    return out
