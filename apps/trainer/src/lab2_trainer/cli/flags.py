"""The command-line flags of ``lab2-train`` and ``lab2-train plan``, built from the settings'
fields (:mod:`lab2_trainer.config`): one flag per field, its default and choices from the
field, its help text from the string literal after it (:func:`field_docs`), grouped as
:data:`GROUPS`.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import fields
from functools import cache
from pathlib import Path
from typing import Any

from lab2_trainer.config import (
    AUTO,
    PRESETS,
    ModelConfig,
    TrainSettings,
    flag,
)

GROUPS = ("model", "data", "optimisation", "parallelism", "outputs")


def setting_fields() -> list[tuple[type, Any]]:
    """(class, field) of every setting with a flag: the model's, then the run's."""
    return [(cls, f) for cls in (ModelConfig, TrainSettings) for f in fields(cls)
            if f.metadata and f.metadata.get("flag", True)]


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's doc: the string literal that follows it in the class body, its first
    paragraph with whitespace collapsed (read with ``ast``; nothing is imported)."""
    source = Path(sys.modules[cls.__module__].__file__).read_text(encoding="utf-8")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            body = node.body
            break
    else:
        return {}
    docs = {}
    for this, after in zip(body, body[1:]):
        if (isinstance(this, ast.AnnAssign) and isinstance(this.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[this.target.id] = " ".join(after.value.value.strip().split("\n\n")[0].split())
    return docs


def _default_text(cls: type, f) -> str:
    meta = f.metadata
    if cls is ModelConfig and f.name in PRESETS["tiny"]:
        return f"the preset's; {PRESETS['tiny'][f.name]} in tiny"
    if "default_text" in meta:
        return meta["default_text"]
    if isinstance(f.default, bool):
        return "on" if f.default else "off"
    return str(f.default)


class OnOffAuto(argparse.Action):
    """A bool setting that may be left to the device: ``--X`` or ``--X on`` (True),
    ``--X off`` (False), ``--X auto`` (:data:`AUTO`: the device's choice); ``--no-X``, a
    flag of its own (:func:`add_setting_flag`), is ``--X off``."""

    VALUES = {"on": True, "off": False, AUTO: AUTO}

    def __init__(self, option_strings: list[str], dest: str, **kw: Any) -> None:
        kw.update(nargs="?", const="on", choices=list(self.VALUES))
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, self.VALUES[values])


def add_setting_flag(group: Any, cls: type, f: Any) -> None:
    """Add the flag of setting field ``f`` of ``cls`` to ``group`` (a parser or a group):
    its type, choices and doc, and a None default, so that a given value can be told
    apart from the field's default."""
    meta, doc = f.metadata, field_docs(cls).get(f.name, "").replace("``", "")
    kind = str(f.type).split(" |")[0]
    kw: dict[str, Any] = {"dest": f.name, "default": None}
    if kind == "bool" and f.default is None:  # None: left to the device
        kw["action"] = OnOffAuto
        # --no-X as the bool flags have it; the doc of --X says so (listed once in --help).
        group.add_argument("--no-" + flag(f.name)[2:], dest=f.name, action="store_const",
                           const=False, default=None, help=argparse.SUPPRESS)
    elif kind == "bool":
        kw["action"] = argparse.BooleanOptionalAction
    else:
        kw["type"] = {"int": int, "float": float}.get(kind, str)
    if meta.get("choices"):
        kw["choices"] = list(meta["choices"])
    kw.update({k: meta[k] for k in ("metavar", "nargs", "const") if k in meta})
    text = f"{doc} (default {_default_text(cls, f)})"
    group.add_argument(flag(f.name), help=text.replace("%", "%%"), **kw)
