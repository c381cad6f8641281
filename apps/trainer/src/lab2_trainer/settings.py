"""Training settings: every knob of a run in one dataclass, checked before any rank starts.

Each field is one setting of ``lab2-train``: its flag, default, choices, check and help
text all come from here (see :func:`lab2_trainer.config.setting`). Defaults that depend on
the device and the number of ranks (``nproc``, ``ddp``, ``sharding``) are None until
:meth:`TrainSettings.resolve` fills them. :func:`to_toml` and :func:`from_toml` write and
read the flat TOML (``settings.toml`` in every run folder) that ``--config`` takes.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from lab2_trainer.config import ModelConfig, check_fields, check_value, setting
from minddp import BUCKET_RULES  # how ``bucket_mb`` cuts buckets; read without torch

DDP_KINDS = ("bucketed", "individual", "flat", "naive", "torch", "none")
SHARDING_KINDS = ("none", "zero1", "zero2", "zero1-allreduce", "torch", "fsdp")
#: The sharding kinds that average gradients themselves, with no DDP wrapper (``--ddp none``):
#: zero1's ShardedOptimizer reduce-scattering them (stages 1 and 2) and PyTorch's FSDP2.
SELF_REDUCING = ("zero1", "zero2", "fsdp")
#: The one precision table: autocast name -> torch dtype name (None: no autocast).
PRECISIONS = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}
#: Which thread runs backward (``TrainSettings.backward_thread``).
BACKWARD_THREADS = ("caller", "autograd")
#: What the backward recomputes (``TrainSettings.activation_checkpointing``).
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
#: Local ranks when ``nproc`` is not given, by device type.
DEFAULT_NPROC = {"cpu": 2, "cuda": 1}


def flag(name: str) -> str:
    """The command-line flag of a setting: ``batch_size`` -> ``--batch-size``."""
    return "--" + name.replace("_", "-")


@dataclass
class TrainSettings:
    """One training run: the model's shape and every other setting of ``lab2-train``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model's shape."""
    data: str | None = setting(None, group="data", default_text="this Python's "
                               "standard-library sources")
    """Text file, folder, or .npy/.bin token array."""
    vocab_size: int | None = setting(None, check="int>=1", flag=False)
    """Vocabulary of a token-array corpus (None: bytes); ``--vocab-size`` sets it and the
    model's."""
    steps: int = setting(200, check="int>=1", group="optimisation")
    """Optimizer steps in the whole run (the schedule's length)."""
    batch_size: int = setting(32, check="int>=1", group="optimisation")
    """Global batch in sequences, over all ranks and micro-batches."""
    grad_accum: int = setting(1, check="int>=1", group="optimisation")
    """Micro-batches per step on each rank."""
    lr: float = setting(3e-3, check="finite>0", group="optimisation")
    """Peak learning rate."""
    min_lr: float = setting(3e-4, check="finite", group="optimisation")
    """Final learning rate, in [0, lr]."""
    warmup: int = setting(20, check="int>=0", group="optimisation")
    """Linear warm-up steps."""
    weight_decay: float = setting(0.1, check="finite>=0", group="optimisation")
    """AdamW decoupled weight decay (matrices only; not norms)."""
    beta1: float = setting(0.9, check="[0,1)", group="optimisation")
    """AdamW's first-moment decay."""
    beta2: float = setting(0.95, check="[0,1)", group="optimisation")
    """AdamW's second-moment decay."""
    clip: float = setting(1.0, check="finite>=0", group="optimisation")
    """Gradient-norm clip (0 turns it off)."""
    precision: str = setting("fp32", choices=tuple(PRECISIONS), group="optimisation")
    """Autocast precision of the forward pass."""
    compile: bool = setting(False, group="optimisation")
    """Wrap the model in ``torch.compile``."""
    compile_backend: str = setting("inductor", group="optimisation")
    """torch.compile's backend ("aot_eager" compiles in seconds and needs no C compiler)."""
    compile_mode: str | None = setting(None, group="optimisation", default_text="none")
    """torch.compile's mode, e.g. max-autotune."""
    backward_thread: str = setting("caller", choices=BACKWARD_THREADS, group="optimisation")
    """Which thread runs backward: "caller" (the training loop's own) or "autograd"
    (PyTorch's default, a worker thread per device). Each rank drives one device, so the
    worker only adds a hand-over, and Python code inside backward (tritonnorm's backward,
    minddp's gradient hooks) runs markedly slower on it."""
    activation_checkpointing: str = setting("none", choices=ACTIVATION_CHECKPOINTING,
                                            group="optimisation")
    """Recompute activations in backward instead of keeping them: "full" reruns every
    block's forward (least memory, a third more FLOPs), "selective" keeps the matrix
    products' and attention's outputs and recomputes the norms and the elementwise rest;
    the losses are the same."""
    seed: int = setting(0, check="seed", group="optimisation")
    """Seed of the weights, the data order and the samples."""
    nproc: int | None = setting(None, check="int>=1", group="parallelism",
                                default_text="2 on CPU, 1 on GPU; ignored under torchrun")
    """Local ranks to spawn."""
    ddp: str | None = setting(None, choices=DDP_KINDS, group="parallelism",
                              default_text="none with zero1, zero2 and fsdp (they average "
                              "gradients themselves); else bucketed with >1 rank, else none")
    """Gradient averaging wrapper: minddp's bucketed, individual, flat or naive; PyTorch's
    DistributedDataParallel (torch); none (one rank, or a sharding that averages
    gradients itself). Only --sharding none, zero1-allreduce and torch take one."""
    bucket_mb: float = setting(25.0, check="finite>0", group="parallelism")
    """Bucket size in MiB: DDP's (bucketed and torch) and zero1/zero2's gradient buckets."""
    bucket_rule: str = setting("reach", choices=BUCKET_RULES, group="parallelism")
    """How bucket_mb cuts minddp's and zero1/zero2's buckets: "reach" closes a bucket once it holds
    bucket_mb, as PyTorch DDP does (the same buckets as torch at the same size);
    "at_most" lets none pass it (about twice as many buckets, each with its own host work
    and collective)."""
    sharding: str | None = setting(None, choices=SHARDING_KINDS, group="parallelism",
                                   default_text="zero1 with >1 rank (zero1-allreduce when "
                                   "--ddp is given), else none")
    """ZeRO sharding: zero1 / zero2 (zero1's ShardedOptimizer stage 1 / 2: gradients
    reduce-scattered in buckets during backward, no DDP wrapper), zero1-allreduce (a --ddp
    wrapper all-reduces, ShardedOptimizer broadcasts its updated shards), torch (a --ddp
    wrapper + PyTorch's ZeroRedundancyOptimizer), fsdp (PyTorch's FSDP2 fully_shard on
    every block and the root, plain AdamW over the sharded parameters), or none."""
    reshard_after_forward: bool = setting(True, group="parallelism")
    """--sharding fsdp: free each block's gathered parameters after its forward and gather
    them again for backward (FSDP2's default); off keeps them to the end of backward (one
    all-gather per step, ZeRO-2's volume, more memory). Ignored by the other kinds."""
    device: str = setting("auto", group="parallelism")
    """auto, cpu or cuda."""
    timeout: float = setting(300.0, check="seconds", group="parallelism", metavar="SECONDS")
    """How long a collective waits for the other ranks, and how long a rank may go silent,
    before the run fails naming it."""
    out: str = setting("runs/latest", group="outputs", default_text="runs/<preset>-<time>")
    """Output folder."""
    resume: str | None = setting(None, group="outputs", nargs="?", const="", metavar="PATH",
                                 default_text="no")
    """Continue from a checkpoint (file or run folder; alone: --out's, or the newest under
    runs/), with every setting of its run unless a flag gives it."""
    ckpt_every: int = setting(0, check="int>=0", group="outputs", default_text="at the end")
    """Checkpoint every N steps."""
    eval_every: int = setting(50, check="int>=0", group="outputs")
    """Validate every N steps (0: only at the end)."""
    eval_batches: int = setting(8, check="int>=1", group="outputs")
    """Validation batches (of batch_size sequences) per evaluation."""
    log_every: int = setting(25, check="int>=1", group="outputs")
    """Log line every N steps when the console is not a terminal."""
    sample_tokens: int = setting(300, check="int>=0", group="outputs")
    """Length of the text sample generated at the end (0: none)."""
    quiet: bool = setting(False, group="outputs")
    """No progress bar nor per-step console output (files are still written)."""
    plot: bool = setting(True, group="outputs")
    """Draw loss_curve.png at the end."""
    device_type: str = setting("cpu", choices=("cpu", "cuda"), flag=False)
    """The device the ranks run on, resolved from ``device``."""

    def resolve(self, world_size: int | None = None, device_type: str | None = None
                ) -> TrainSettings:
        """Fill the defaults that depend on the device and the number of ranks.

        Args:
            world_size: the ranks there are (under torchrun); None: ``nproc``, or
                :data:`DEFAULT_NPROC` of the device type.
            device_type: "cpu" or "cuda" (None: keep ``device_type``).

        Raises:
            ValueError: a bad ``nproc``.
        """
        if device_type is not None:
            self.device_type = device_type
        nproc_meta = next(f.metadata for f in dataclasses.fields(self) if f.name == "nproc")
        check_value(flag("nproc"), self.nproc, nproc_meta)
        if world_size is None:
            world_size = self.nproc or DEFAULT_NPROC.get(self.device_type, 1)
        self.nproc = world_size
        if self.sharding is None:
            if world_size == 1:
                self.sharding = "none"
            else:  # --ddp X alone keeps the DDP-wrapper pairing
                self.sharding = ("zero1-allreduce" if self.ddp not in (None, "none")
                                 else "zero1")
        if self.ddp is None:
            self.ddp = ("bucketed" if world_size > 1 and self.sharding not in SELF_REDUCING
                        else "none")
        return self

    def validate(self, world_size: int) -> TrainSettings:
        """Check the settings for ``world_size`` ranks (resolving what is still unset);
        ``ValueError`` with one line naming the first bad setting."""
        self.model.validate()
        if self.ddp is None or self.sharding is None or self.nproc is None:
            self.resolve(world_size)
        check_fields(self, flag)
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"--min-lr must be in [0, --lr = {self.lr}], got {self.min_lr}")
        if self.sharding in SELF_REDUCING and self.ddp != "none":
            raise ValueError(f"--sharding {self.sharding} averages gradients itself, without "
                             f"a DDP wrapper: drop --ddp {self.ddp} (--sharding "
                             "zero1-allreduce pairs a --ddp wrapper with zero1)")
        if self.sharding in SELF_REDUCING and self.precision == "fp16":
            raise ValueError(f"--precision fp16 needs a gradient scaler that reads every "
                             f"averaged gradient, which --sharding {self.sharding} does not "
                             "leave on the model: use bf16")
        if self.sharding in ("zero1-allreduce", "torch") and self.ddp == "none" \
                and world_size > 1:
            raise ValueError(f"--sharding {self.sharding} needs a --ddp variant")
        if self.ddp == "none" and world_size > 1 and self.sharding not in SELF_REDUCING:
            raise ValueError(f"--ddp none cannot average gradients over {world_size} ranks")
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
        """Inverse of :meth:`to_dict` (unknown keys are ignored: newer checkpoints; missing
        ones take their defaults: older checkpoints)."""
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in values.items() if k in known}
        kwargs["model"] = ModelConfig.from_dict(values["model"])
        return cls(**kwargs)


# Not written to settings.toml: where a run resumed from is not part of what it is, and
# the device type is written as ``device``.
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
        if f.name not in _NOT_WRITTEN and value is not None:
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
