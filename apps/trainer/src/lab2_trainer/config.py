"""Model configuration: one dataclass, the course handout's size presets, and validation.

``model_config("small", n_layers=2)`` is the usual way to get one: a preset's fields with
any of them overridden, checked before it is returned.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

NORM_KINDS = ("tritonnorm", "reference", "torch", "layernorm")
FFN_KINDS = ("swiglu", "gelu")


@dataclass
class ModelConfig:
    """Shape of a decoder-only Transformer language model.

    Every field has a default so that ``ModelConfig()`` is a valid (tiny) model.
    """

    vocab_size: int = 256
    """Number of token ids; 256 for raw bytes."""
    context_length: int = 128
    """Longest sequence the model takes (size of the learned position table)."""
    d_model: int = 128
    """Width of the residual stream."""
    n_layers: int = 4
    """Number of decoder blocks."""
    n_heads: int = 4
    """Attention heads per block; must divide ``d_model``."""
    d_ff: int = 512
    """Hidden width of the feed-forward layer."""
    norm: str = "tritonnorm"
    """Norm layer: "tritonnorm" (fused RMSNorm), "reference" (RMSNorm with a hand-derived
    backward in plain PyTorch), "torch" (``torch.nn.RMSNorm``) or "layernorm"."""
    eps: float = 1e-5
    """Epsilon inside the norm's square root."""
    tie_embeddings: bool = False
    """Share the token embedding matrix with the output (LM head) projection."""
    ffn: str = "swiglu"
    """Feed-forward kind: "swiglu" (three matrices, SiLU gate) or "gelu" (two matrices)."""

    def validate(self) -> ModelConfig:
        """Check every field; raise ``ValueError`` with one line naming the bad one.

        Returns:
            ``self``, so that ``ModelConfig(...).validate()`` chains.
        """
        for name in ("vocab_size", "context_length", "d_model", "n_layers", "n_heads", "d_ff"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"n_heads={self.n_heads} does not divide d_model={self.d_model} "
                f"(each head needs d_model / n_heads dimensions)"
            )
        if self.norm not in NORM_KINDS:
            raise ValueError(f"norm must be one of {', '.join(NORM_KINDS)}; got {self.norm!r}")
        if self.ffn not in FFN_KINDS:
            raise ValueError(f"ffn must be one of {', '.join(FFN_KINDS)}; got {self.ffn!r}")
        if not (isinstance(self.eps, (int, float)) and 0 < self.eps < 1):
            raise ValueError(f"eps must be a number in (0, 1), got {self.eps!r}")
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
# entropy in a few minutes on 2 CPU cores.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=128, d_ff=384, n_layers=3, n_heads=4, context_length=128),
    "small": dict(d_model=768, d_ff=3072, n_layers=12, n_heads=12, context_length=512),
    "medium": dict(d_model=1024, d_ff=4096, n_layers=24, n_heads=16, context_length=512),
    "large": dict(d_model=1280, d_ff=5120, n_layers=36, n_heads=20, context_length=512),
    "xl": dict(d_model=1600, d_ff=6400, n_layers=48, n_heads=25, context_length=512),
    "2.7B": dict(d_model=2560, d_ff=10240, n_layers=32, n_heads=32, context_length=512),
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
