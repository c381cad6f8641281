"""Model configuration: one dataclass, the course handout's size presets, and validation.

``model_config("small", n_layers=2)`` is the usual way to get one: a preset's fields with
any of them overridden, checked before it is returned.

Each field of :class:`ModelConfig` (and of :class:`lab2_trainer.settings.TrainSettings`)
is one setting: its default, its choices and its check live in the field
(:func:`setting`), its help text is the string literal right after it (read by
:func:`field_docs` without importing anything), and ``lab2-train``'s flags are built from
them.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from tritonnorm.limits import EPS_RANGE, eps_in_range

NORM_KINDS = ("tritonnorm", "reference", "torch", "layernorm")
FFN_KINDS = ("swiglu", "gelu")

#: The largest integer any setting takes: torch's int64 (sizes, steps, seeds).
INT_LIMIT = 2**63
#: The longest wait a setting in seconds takes (``--timeout``): a year, well inside what
#: ``datetime.timedelta`` and the process group's millisecond timeouts hold.
MAX_SECONDS = 365 * 86400.0

#: What a field's ``check`` may say, and the sentence a bad value gets.
CHECKS = {
    "positive_int": "must be a positive integer",
    "int>=1": "must be >= 1",
    "int>=0": "must be >= 0",
    "seed": "must be in [0, 2**63)",
    "finite": "must be a finite number",
    "finite>0": "must be > 0",
    "seconds": f"must be > 0 and at most {MAX_SECONDS:,.0f} (a year)",
    "finite>=0": "must be >= 0",
    "[0,1)": "must be in [0, 1)",
    # tritonnorm's own range (tritonnorm.limits imports no torch).
    "eps": f"must be {EPS_RANGE}",
}


def setting(default: Any = None, *, choices: tuple[str, ...] | None = None,
            check: str | None = None, group: str | None = None, **cli: Any) -> Any:
    """A dataclass field that is also a command-line setting.

    Args:
        default: the default value.
        choices: the allowed values of a string setting.
        check: a key of :data:`CHECKS`: the range of a number.
        group: the ``--help`` section of its flag.
        **cli: how the flag is shown or parsed: ``default_text`` (the default as help
            prints it, for defaults resolved later), ``metavar``, ``nargs`` and
            ``const``; ``flag=False`` for a field with no flag.
    """
    if check is not None and check not in CHECKS:
        raise ValueError(f"unknown check {check!r}")
    meta = {"choices": choices, "check": check, "group": group, **cli}
    return dataclasses.field(default=default, metadata=meta)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_value(label: str, value: Any, meta: Any) -> None:
    """Check one setting against its field's ``choices`` and ``check``.

    Raises:
        ValueError: ``"<label> must be ..., got <value>"``.
    """
    choices, check = meta.get("choices"), meta.get("check")
    if choices is not None and value not in choices:
        raise ValueError(f"{label} must be one of {', '.join(choices)}; got {value!r}")
    if check is None or value is None:
        return
    if check in ("positive_int", "int>=1", "int>=0", "seed"):
        if isinstance(value, bool) or not isinstance(value, int):
            what = "a positive integer" if check == "positive_int" else "an integer"
            raise ValueError(f"{label} must be {what}, got {value!r}")
        low = 0 if check == "int>=0" or check == "seed" else 1
        if value < low or (check == "seed" and value >= INT_LIMIT):
            raise ValueError(f"{label} {CHECKS[check]}, got {value!r}")
        if value >= INT_LIMIT:  # before any arithmetic: torch sizes and counters are int64
            raise ValueError(f"{label} must be < 2**63, got {value!r}")
        return
    finite = _is_number(value) and math.isfinite(value)
    if check == "eps":
        ok = _is_number(value) and eps_in_range(value)
    elif not finite:
        raise ValueError(f"{label} must be a finite number, got {value!r}")
    else:
        ok = {"finite": True, "finite>0": value > 0, "finite>=0": value >= 0,
              "[0,1)": 0 <= value < 1, "seconds": 0 < value <= MAX_SECONDS}[check]
    if not ok:
        raise ValueError(f"{label} {CHECKS[check]}, got {value!r}")


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


def check_fields(obj: Any, label=lambda name: name) -> None:
    """Run :func:`check_value` on every field of the dataclass ``obj``, in order."""
    for f in dataclasses.fields(obj):
        if f.metadata:
            check_value(label(f.name), getattr(obj, f.name), f.metadata)


@dataclass
class ModelConfig:
    """Shape of a decoder-only Transformer language model.

    Every field has a default so that ``ModelConfig()`` is a valid (tiny) model.
    """

    vocab_size: int = setting(256, check="positive_int", group="data")
    """Number of token ids: 256 for bytes (text), or the vocabulary of a token-array --data."""
    context_length: int = setting(128, check="positive_int", group="model")
    """Longest sequence the model takes (size of the learned position table)."""
    d_model: int = setting(128, check="positive_int", group="model")
    """Width of the residual stream."""
    n_layers: int = setting(4, check="positive_int", group="model")
    """Number of decoder blocks."""
    n_heads: int = setting(4, check="positive_int", group="model")
    """Attention heads per block; must divide ``d_model``."""
    d_ff: int = setting(512, check="positive_int", group="model")
    """Hidden width of the feed-forward layer."""
    norm: str = setting("tritonnorm", choices=NORM_KINDS, group="model")
    """Norm layer: "tritonnorm" (fused RMSNorm), "reference" (RMSNorm with a hand-derived
    backward in plain PyTorch), "torch" (``torch.nn.RMSNorm``) or "layernorm"."""
    eps: float = setting(1e-5, check="eps", group="model")
    """Epsilon inside the norm's square root."""
    tie_embeddings: bool = setting(False, group="model")
    """Share the token embedding matrix with the output (LM head) projection."""
    ffn: str = setting("swiglu", choices=FFN_KINDS, group="model")
    """Feed-forward kind: "swiglu" (three matrices, SiLU gate) or "gelu" (two matrices)."""

    def validate(self) -> ModelConfig:
        """Check every field; raise ``ValueError`` with one line naming the bad one.

        Returns:
            ``self``, so that ``ModelConfig(...).validate()`` chains.
        """
        check_fields(self)
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"n_heads={self.n_heads} does not divide d_model={self.d_model} "
                f"(each head needs d_model / n_heads dimensions)"
            )
        return self

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields (for checkpoints and JSON)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> ModelConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError``."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"unknown model config field(s): {', '.join(unknown)}")
        return cls(**fields).validate()


# The course handout's sizes, plus `tiny`, which trains to well below the byte-unigram
# entropy in a few minutes on 2 CPU cores. 6.7B and 13B are the GPT-3 table's widths, depths
# and heads; their SwiGLU width is 8/3 d_model rounded up to a multiple of 256 (the handout's
# 4 d_model with three SwiGLU matrices would make them 8.6B and 16.8B), so that their
# parameters match their names as GPT-3's GELU layers of 4 d_model do (12 d_model^2 a block).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=128, d_ff=384, n_layers=3, n_heads=4, context_length=128),
    "small": dict(d_model=768, d_ff=3072, n_layers=12, n_heads=12, context_length=512),
    "medium": dict(d_model=1024, d_ff=4096, n_layers=24, n_heads=16, context_length=512),
    "large": dict(d_model=1280, d_ff=5120, n_layers=36, n_heads=20, context_length=512),
    "xl": dict(d_model=1600, d_ff=6400, n_layers=48, n_heads=25, context_length=512),
    "2.7B": dict(d_model=2560, d_ff=10240, n_layers=32, n_heads=32, context_length=512),
    "6.7B": dict(d_model=4096, d_ff=11008, n_layers=32, n_heads=32, context_length=512),
    "13B": dict(d_model=5120, d_ff=13824, n_layers=40, n_heads=40, context_length=512),
}


def model_config(preset: str = "tiny", **overrides: Any) -> ModelConfig:
    """A preset's configuration with some fields replaced, validated.

    Args:
        preset: a key of :data:`PRESETS`.
        **overrides: ``ModelConfig`` fields; ``None`` values are ignored (so that unset
            command-line options can be passed straight through).

    Raises:
        ValueError: unknown preset, unknown field, or an invalid combination.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    fields = dict(PRESETS[preset])
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return ModelConfig.from_dict(fields)
