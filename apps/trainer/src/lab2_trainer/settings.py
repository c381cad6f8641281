"""Training settings: every knob of a run in one dataclass, checked before any rank starts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from lab2_trainer.config import ModelConfig

DDP_KINDS = ("bucketed", "individual", "flat", "naive", "torch", "none")
SHARDING_KINDS = ("none", "zero1", "torch")
PRECISIONS = ("fp32", "bf16", "fp16")

# Settings that define the training trajectory: a resumed run keeps the checkpoint's
# values unless the command line names them again.
TRAJECTORY_FIELDS = ("data", "vocab_size", "steps", "batch_size", "grad_accum", "lr", "min_lr",
                     "warmup", "weight_decay", "beta1", "beta2", "clip", "seed", "precision")


@dataclass
class TrainSettings:
    """One training run.

    Attributes:
        model: the model's shape.
        data: corpus path (None: the standard library's sources).
        vocab_size: vocabulary of a token-array corpus.
        steps: optimizer steps in the whole run (the schedule's length).
        batch_size: global batch in sequences, over all ranks and micro-batches.
        grad_accum: micro-batches per step on each rank.
        lr, min_lr: peak and final learning rate.
        warmup: linear warm-up steps.
        weight_decay: AdamW decoupled weight decay (matrices only; not norms).
        beta1, beta2: AdamW betas.
        clip: gradient-norm clip (0 turns it off).
        precision: "fp32", "bf16" or "fp16" autocast.
        compile: wrap the model in ``torch.compile``.
        compile_backend: ``torch.compile``'s backend ("inductor"; "aot_eager" compiles in
            seconds and needs no C compiler).
        compile_mode: ``torch.compile``'s mode (None, "max-autotune", ...).
        ddp: gradient averaging: minddp's "bucketed", "individual", "flat", "naive";
            PyTorch's "torch" (DistributedDataParallel); "none" (one rank only).
        bucket_mb: bucket size for "bucketed" and "torch".
        sharding: optimizer state: "none", "zero1" (ShardedOptimizer) or "torch"
            (ZeroRedundancyOptimizer).
        out: output folder.
        ckpt_every: checkpoint every this many steps (0: only at the end).
        eval_every: validation every this many steps (0: only at the end).
        eval_batches: validation batches (of ``batch_size`` sequences) per evaluation.
        log_every: console log line every this many steps when not on a terminal.
        seed: seeds weights, data order and sampling.
        device_type: "cpu" or "cuda".
        resume: checkpoint to continue from.
        sample_tokens: length of the text sample generated at the end (0: none).
        quiet: no progress bar nor per-step console output (files are still written).
        plot: draw the loss-curve PNG at the end.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    data: str | None = None
    vocab_size: int | None = None
    steps: int = 200
    batch_size: int = 32
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    clip: float = 1.0
    precision: str = "fp32"
    compile: bool = False
    compile_backend: str = "inductor"
    compile_mode: str | None = None
    ddp: str = "bucketed"
    bucket_mb: float = 25.0
    sharding: str = "zero1"
    out: str = "runs/latest"
    ckpt_every: int = 0
    eval_every: int = 50
    eval_batches: int = 8
    log_every: int = 25
    seed: int = 0
    device_type: str = "cpu"
    resume: str | None = None
    sample_tokens: int = 300
    quiet: bool = False
    plot: bool = True

    def validate(self, world_size: int) -> TrainSettings:
        """Check the settings for ``world_size`` ranks; ``ValueError`` with one line."""
        self.model.validate()
        positive = ("steps", "batch_size", "grad_accum", "eval_batches", "log_every")
        for name in positive:
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        for name in ("warmup", "ckpt_every", "eval_every", "sample_tokens"):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
        if not self.lr > 0 or not 0 <= self.min_lr <= self.lr:
            raise ValueError(
                f"need --lr > 0 and 0 <= --min-lr <= --lr (got {self.lr}, {self.min_lr})"
            )
        if self.clip < 0 or self.weight_decay < 0:
            raise ValueError("--clip and --weight-decay must be >= 0")
        if self.ddp not in DDP_KINDS:
            raise ValueError(f"--ddp must be one of {', '.join(DDP_KINDS)}")
        if self.sharding not in SHARDING_KINDS:
            raise ValueError(f"--sharding must be one of {', '.join(SHARDING_KINDS)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}")
        if self.ddp == "none" and world_size > 1:
            raise ValueError(f"--ddp none cannot average gradients over {world_size} ranks")
        if self.sharding == "torch" and self.ddp in ("none",) and world_size > 1:
            raise ValueError("--sharding torch needs a --ddp variant")
        if self.bucket_mb <= 0:
            raise ValueError(f"--bucket-mb must be > 0, got {self.bucket_mb}")
        if self.vocab_size is not None and self.vocab_size != self.model.vocab_size:
            raise ValueError(
                f"--vocab-size {self.vocab_size} differs from the model's {self.model.vocab_size}"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (checkpoints load with ``weights_only=True``)."""
        out = dataclasses.asdict(self)
        out["model"] = self.model.to_dict()
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainSettings:
        """Inverse of :meth:`to_dict` (unknown keys are ignored: newer checkpoints)."""
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in values.items() if k in known}
        kwargs["model"] = ModelConfig.from_dict(values["model"])
        return cls(**kwargs)
