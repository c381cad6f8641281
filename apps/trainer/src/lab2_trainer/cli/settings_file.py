"""``settings.toml``: a run's resolved settings as flat TOML, written into every run folder
(:func:`to_toml`) and read back by ``--config`` (:func:`from_toml`): the training settings as
top-level keys, the model's under ``[model]``; values checked against each field's type.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from lab2_trainer.config import AUTO, ModelConfig, TrainSettings

_NOT_WRITTEN = ("model", "resume", "device_type")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        text = repr(value)
        return text if any(c in text for c in ".en") else text + ".0"
    if isinstance(value, str):
        # A TOML basic string: JSON's escapes are TOML's, and TOML also escapes DEL.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def to_toml(settings: TrainSettings) -> str:
    """The settings as TOML that :func:`from_toml` (and ``--config``) reads back: the
    training settings as top-level keys, the model's under ``[model]``; None values are
    left out (they are the defaults)."""
    lines = ["# lab2-train settings: lab2-train --config settings.toml [flags] reruns them"]
    for f in dataclasses.fields(settings):
        value = settings.device_type if f.name == "device" else getattr(settings, f.name)
        if f.name not in _NOT_WRITTEN and value is not None and (value or f.name != "auto"):
            lines.append(f"{f.name} = {_toml_value(value)}")
    lines += ["", "[model]"]
    for f in dataclasses.fields(settings.model):
        lines.append(f"{f.name} = {_toml_value(getattr(settings.model, f.name))}")
    return "\n".join(lines) + "\n"


def _typed(owner: str, f: dataclasses.Field, value: Any) -> Any:
    """A TOML value as the field's type (an integer where a float is wanted becomes one)."""
    kind = str(f.type).split(" |")[0]
    label = f"{owner}{f.name}"
    if kind == "float" and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # TOML integers are unbounded here
            raise ValueError(f"{label} must be a finite number, got {value!r}") from None
    want = {"int": int, "float": float, "str": str, "bool": bool}.get(kind)
    if want is not None and (not isinstance(value, want)
                             or (want is int and isinstance(value, bool))):
        raise ValueError(f"{label} must be of type {kind}, got {value!r}")
    return value


def from_toml(text: str, source: str = "settings") -> tuple[dict[str, Any], dict[str, Any]]:
    """Read settings TOML into (training settings, model fields), both only the keys given.

    A ``preset`` key is returned among the training settings; a top-level ``vocab_size``
    is the data's vocabulary and the model's, as ``--vocab-size`` is.

    Raises:
        ValueError: not TOML, an unknown key, or a value of the wrong type.
    """
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{source} is not valid TOML: {exc}") from None
    model = data.pop("model", {})
    if not isinstance(model, dict):
        raise ValueError(f"{source}: model must be a table")
    train_fields = {f.name: f for f in dataclasses.fields(TrainSettings)
                    if f.name not in ("model", "device_type")}
    model_fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    train: dict[str, Any] = {}
    for key, value in data.items():
        if key == "preset":
            if not isinstance(value, str):
                raise ValueError(f"{source}: preset must be a string (a preset's name), got "
                                 f"{value!r}")
            train[key] = value
        elif key == "compile" and value == AUTO:
            train[key] = None  # left to the device
        elif key in train_fields:
            train[key] = _typed(f"{source}: ", train_fields[key], value)
        else:
            raise ValueError(f"{source}: unknown setting {key!r}")
    fields: dict[str, Any] = {}
    for key, value in model.items():
        if key not in model_fields:
            raise ValueError(f"{source}: unknown model setting {key!r}")
        fields[key] = _typed(f"{source}: model.", model_fields[key], value)
    return train, fields
