"""Settings of a run: the model's shape, every training setting, and the error for bad input.

* :class:`UsageError`: the one exception type that means "the user asked for something
  that cannot work" (options, data, checkpoint); reported as one line on stderr, exit
  code 2.
* The setting machinery. Each field of :class:`ModelConfig` and of :class:`TrainSettings`
  is one setting: its default and its choices live in the field (:func:`setting`), its
  help text is the string literal right after it (read without importing anything by
  :mod:`lab2_trainer.cli.flags`, which builds ``lab2-train``'s flags from them). Each
  class's ``check`` method checks every field's range in plain Python, in field order.
* Model configuration: :class:`ModelConfig`, size presets (:data:`PRESETS`), validation;
  ``model_config("small", n_layers=2)``: a preset's fields, some overridden, checked.
* Training settings: every knob of a run in :class:`TrainSettings`, checked before any
  rank starts. Defaults that depend on the device and the number of ranks (``nproc``,
  ``ddp``, ``sharding``) are None until :meth:`TrainSettings.resolve` fills them, and so
  are ``precision`` and ``compile`` left to the device ("auto": :func:`device_defaults`).
  :mod:`lab2_trainer.cli.settings_file` writes and reads them as the flat TOML
  (``settings.toml`` in every run folder) that ``--config`` takes.
* The rules of one concept live with it, and the checks here ask them: the ranks' layout
  (:mod:`lab2_trainer.recipe.layout`: sharding kinds, DDP wrappers, what ``--tp`` cuts)
  and Muon's (:mod:`lab2_trainer.recipe.muon`). Float8's need the device and live with
  the float8 model (:mod:`lab2_trainer.models.float8`), asked before any rank starts
  (:func:`lab2_trainer.cli.checks.check_fp8`).

Nothing here imports torch: ``lab2-train --help`` and the bench suites' ``--help`` read
these settings and must stay quick.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lab2_trainer.recipe.defaults import EMBED_SCALE
from lab2_trainer.recipe.layout import (
    DDP_KINDS,
    SHARDING_KINDS,
    data_parallel_ranks,
    default_layout,
    layout_problem,
    tp_problem,
)
from lab2_trainer.recipe.muon import MUON_LR, OPTIMIZERS, default_muon_lr, muon_problem
from minddp import BUCKET_RULES  # how ``bucket_mb`` cuts buckets; read without torch
from tritonnorm.limits import EPS_RANGE, eps_in_range


# ------------------------------------------------------------------------------- error
class UsageError(Exception):
    """Bad input (options, data, checkpoint): reported as one line on stderr, exit code 2."""


class Diverged(RuntimeError):
    """The training loss became NaN or infinite: every rank sees it at the same step (the
    loss is averaged first), rank 0 alone reports it in one line; exit code 1."""


#: The exit code of every command line of the trainer on bad input (a ``UsageError``).
EXIT_BAD_INPUT = 2


# ------------------------------------------ settings machinery and model configuration
NORM_KINDS = ("tritonnorm", "reference", "torch", "layernorm")
FFN_KINDS = ("swiglu", "gelu", "relu2")

#: The largest integer any setting takes: torch's int64 (sizes, steps, seeds).
INT_LIMIT = 2**63
#: The longest wait in seconds (``--timeout``): a year, inside timedelta's and Gloo's range.
MAX_SECONDS = 365 * 86400.0


def setting(default: Any = None, *, choices: tuple[str, ...] | None = None,
            group: str | None = None, **cli: Any) -> Any:
    """A dataclass field that is also a command-line setting (range checked by ``check``).

    Args:
        default: the default value.
        choices: the allowed values of a string setting (the flag's choices).
        group: the ``--help`` section of its flag.
        **cli: how the flag is shown or parsed: ``default_text`` (the default as help
            prints it, for defaults resolved later), ``metavar``, ``nargs`` and
            ``const``; ``flag=False`` for a field with no flag.
    """
    meta = {"choices": choices, "group": group, **cli}
    return dataclasses.field(default=default, metadata=meta)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _one_of(label: str, value: Any, choices: Any) -> None:
    if value not in choices:
        raise ValueError(f"{label} must be one of {', '.join(choices)}; got {value!r}")


def _integer(label: str, value: Any, low: int, *, what: str = "an integer",
             below: str | None = None, above: str = "< 2**63") -> None:
    """``value`` is None or an integer in [``low``, 2**63); else ``ValueError`` saying
    ``"<label> must be <what>"`` (not an integer), ``<below>`` (default ``>= <low>``) or
    ``<above>``."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{label} must be {what}, got {value!r}")
    if value < low:
        raise ValueError(f"{label} must be {below or f'>= {low}'}, got {value!r}")
    if value >= INT_LIMIT:  # before any arithmetic: torch sizes and counters are int64
        raise ValueError(f"{label} must be {above}, got {value!r}")


def _number(label: str, value: Any, ok: Callable[[float], bool] = lambda v: True,
            must: str = "") -> None:
    """``value`` is None or a finite number for which ``ok`` holds; else ``ValueError``
    saying ``"<label> must be a finite number"`` or ``"<label> must be <must>"``."""
    if value is None:
        return
    if not (_is_number(value) and math.isfinite(value)):
        raise ValueError(f"{label} must be a finite number, got {value!r}")
    if not ok(value):
        raise ValueError(f"{label} must be {must}, got {value!r}")


def stdlib_share_problem(share: float, data: str | None) -> str | None:
    """Why ``--stdlib-share share`` cannot mix into ``--data data`` (None: it can; whether
    the data are bytes is known once they are read: ``data.corpus.load_corpus``)."""
    if not (_is_number(share) and 0 <= share < 1):  # None too: Python callers pass anything
        return f"--stdlib-share must be in [0, 1), got {share!r}"
    if share > 0 and data is None:
        return ("--stdlib-share mixes the standard library into another --data; without "
                "--data the run trains on the standard library alone already")
    return None


def _refuse(problem: str | None) -> None:
    """``ValueError`` with ``problem``, a concept's rule's one line (None: nothing wrong)."""
    if problem is not None:
        raise ValueError(problem)


@dataclass
class ModelConfig:
    """Shape of a decoder-only Transformer language model.

    Every field has a default so that ``ModelConfig()`` is a valid (tiny) model.
    """

    vocab_size: int = setting(256, group="data")
    """Number of token ids: 256 for bytes (text), or the vocabulary of a token-array --data."""
    context_length: int = setting(128, group="model")
    """Longest sequence the model takes (size of the learned position table)."""
    d_model: int = setting(128, group="model")
    """Width of the residual stream."""
    n_layers: int = setting(4, group="model")
    """Number of decoder blocks."""
    n_heads: int = setting(4, group="model")
    """Attention heads per block; must divide ``d_model``."""
    d_ff: int = setting(512, group="model")
    """Hidden width of the feed-forward layer."""
    norm: str = setting("tritonnorm", choices=NORM_KINDS, group="model")
    """Norm layer: "tritonnorm" (fused RMSNorm), "reference" (RMSNorm with a hand-derived
    backward in plain PyTorch), "torch" (``torch.nn.RMSNorm``) or "layernorm"."""
    eps: float = setting(1e-5, group="model")
    """Epsilon inside the norm's square root."""
    tie_embeddings: bool = setting(False, group="model")
    """Share the token embedding matrix with the output (LM head) projection."""
    ffn: str = setting("swiglu", choices=FFN_KINDS, group="model")
    """Feed-forward kind: "swiglu" (three matrices, SiLU gate), "gelu" or "relu2" (two
    matrices; ReLU squared)."""
    embed_scale: float = setting(EMBED_SCALE, group="model", default_text="35.36")
    """Multiplier of the embedding: with N(0, 0.02) tables, a unit-RMS residual stream at
    the start (lab2_trainer.recipe.defaults says why)."""
    dropout: float = setting(0.0, group="model")
    """Dropout rate on the embedding and each attention and feed-forward output in training
    (0: none); 0.1 did not help medium (docs/benchmarks/2026-12-05-h100-quality.md)."""
    rope: bool = setting(True, group="model")
    """Rotary positions on q and k (base 10000) instead of the learned position table
    (``--no-rope``: the table; lab2_trainer.recipe.defaults says why rope is the default)."""
    qk_norm: bool = setting(True, group="model")
    """RMS-normalise q and k of each head (no weight) before attention (``--no-qk-norm``:
    plain attention)."""
    zero_init_proj: bool = setting(False, group="model")
    """Initialise attention's ``proj`` and the feed-forward's ``w2`` to zero."""
    logit_softcap: float = setting(0.0, group="model")
    """Logits become cap * tanh(logits / cap) before the loss and sampling (0: off)."""

    def check(self) -> None:
        """Each field in its range, in field order; ``ValueError`` naming the first bad one."""
        for name in ("vocab_size", "context_length", "d_model", "n_layers", "n_heads", "d_ff"):
            _integer(name, getattr(self, name), 1, what="a positive integer",
                     below="a positive integer")
        _one_of("norm", self.norm, NORM_KINDS)
        # tritonnorm's own range (tritonnorm.limits imports no torch).
        if self.eps is not None and not (_is_number(self.eps) and eps_in_range(self.eps)):
            raise ValueError(f"eps must be {EPS_RANGE}, got {self.eps!r}")
        _one_of("ffn", self.ffn, FFN_KINDS)
        _number("embed_scale", self.embed_scale, lambda v: v > 0, "> 0")
        _number("dropout", self.dropout, lambda v: 0 <= v < 1, "in [0, 1)")
        _number("logit_softcap", self.logit_softcap, lambda v: v >= 0, ">= 0")

    def validate(self) -> ModelConfig:
        """Check every field (:meth:`check`), that the heads divide the width (evenly with
        rope); raise ``ValueError`` naming the bad one. Returns ``self``, to chain."""
        self.check()
        if self.d_model % self.n_heads != 0:
            raise ValueError(f"n_heads={self.n_heads} does not divide d_model={self.d_model} "
                             "(each head needs d_model / n_heads dimensions)")
        if self.rope and self.head_dim % 2:
            raise ValueError(f"rope needs an even head width, got {self.head_dim} "
                             f"(d_model {self.d_model} / n_heads {self.n_heads}): choose "
                             "another n_heads, or pass --no-rope for learned positions")
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
        """Inverse of :meth:`to_dict` (a saved configuration); unknown keys raise
        ``ValueError``, and a field it lacks takes the value the model was trained with
        before that field existed (:data:`BEFORE_FIELDS`), else its default."""
        return cls.with_fields({**BEFORE_FIELDS, **fields})

    @classmethod
    def with_fields(cls, fields: dict[str, Any]) -> ModelConfig:
        """A validated configuration of ``fields``, the rest defaults; unknown keys raise
        ``ValueError``."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"unknown model config field(s): {', '.join(unknown)}")
        return cls(**fields).validate()


#: What a saved model configuration that lacks a field was trained with: models saved
#: before ``embed_scale`` existed had no embedding multiplier, and those saved before
#: ``rope`` and ``qk_norm`` existed had learned positions and plain attention.
BEFORE_FIELDS: dict[str, Any] = {"embed_scale": 1.0, "rope": False, "qk_norm": False}


# The course handout's sizes, plus `tiny` (below the byte-unigram entropy in minutes on 2 CPU
# cores). 6.7B and 13B: GPT-3's widths, depths and heads, SwiGLU width 8/3 d_model rounded up
# to a multiple of 256 so that their parameters match their names (12 d_model^2 a block).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=128, d_ff=384, n_layers=3, n_heads=4, context_length=64),
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
    return ModelConfig.with_fields(fields)


# ------------------------------------------------------------------- training settings
#: The one precision table: autocast name -> torch dtype name (None: no autocast). fp8 is
#: bf16 autocast with the blocks' matrix products in float8 (lab2_trainer.models.float8).
PRECISIONS = {"fp32": None, "bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}
#: How fp8 scales its operands (``TrainSettings.fp8_recipe``): torchao's recipes.
FP8_RECIPES = ("tensorwise", "rowwise")
#: What ``--compile`` compiles (``TrainSettings.compile_scope``).
COMPILE_SCOPES = ("blocks", "model")
#: Which thread runs backward (``TrainSettings.backward_thread``).
BACKWARD_THREADS = ("caller", "autograd")
#: What the backward recomputes (``TrainSettings.activation_checkpointing``).
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
#: The device types the ranks run on (``TrainSettings.device_type``).
DEVICE_TYPES = ("cpu", "cuda")
#: Local ranks when ``nproc`` is not given, by device type.
DEFAULT_NPROC = {"cpu": 2, "cuda": 1}
#: The value of a setting left to the device (``--precision auto``, ``--compile auto``).
AUTO = "auto"
#: The settings a run may leave to its device, in field order.
AUTO_SETTINGS = ("precision", "compile")


def device_defaults(device_type: str, bf16: bool) -> dict[str, Any]:
    """The settings left to the device (:data:`AUTO_SETTINGS`) on it: bf16 and compilation
    (``--compile-scope``) on a CUDA device with bf16 (``torch.cuda.is_bf16_supported()``),
    else fp32 and eager (the CPU's: there they cost more than they save)."""
    fast = device_type == "cuda" and bf16
    return {"precision": "bf16" if fast else "fp32", "compile": fast}


def step_range(label: str, text: Any) -> tuple[int, int]:
    """``"A:B"`` as the steps (A, B), with 1 <= A <= B; else ``ValueError`` naming
    ``label``."""
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text, re.ASCII) \
        if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"{label} must be A:B, two step numbers, got {text!r}")
    a, b = int(match[1]), int(match[2])
    if not 1 <= a <= b:
        raise ValueError(f"{label} must be A:B with 1 <= A <= B, got {text!r}")
    _integer(label, b, 1)
    return a, b


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
    """Text file, folder, .npy/.bin token array, or python-env: every .py source of this
    Python (standard library and site-packages), validated on the default corpus's split."""
    stdlib_share: float = setting(0.0, group="data", metavar="SHARE")
    """Share of training windows drawn from the standard library's training split instead of
    --data's (python-env: toward the validation split's kind of text); 0: none."""
    vocab_size: int | None = setting(None, flag=False)
    """Vocabulary of a token-array corpus (None: bytes); ``--vocab-size`` sets it and the
    model's."""
    steps: int = setting(200, group="optimisation")
    """Optimizer steps in the whole run (the schedule's length)."""
    batch_size: int = setting(32, group="optimisation", default_text="32 (64 in tiny)")
    """Global batch in sequences, over all ranks and micro-batches."""
    grad_accum: int = setting(1, group="optimisation")
    """Micro-batches per step on each rank."""
    lr: float | None = setting(None, group="optimisation",
                               default_text="0.4 / d_model (5.2e-4 in small); 6e-3 in tiny")
    """Peak learning rate (lab2_trainer.recipe.defaults: GPT-3's table as one rule over the
    width)."""
    min_lr: float | None = setting(None, group="optimisation", default_text="lr / 10")
    """Final learning rate, in [0, lr]."""
    warmup: int | None = setting(None, group="optimisation",
                                 default_text="5% of --steps, within [20, 500]")
    """Linear warm-up steps."""
    weight_decay: float = setting(0.1, group="optimisation")
    """Decoupled weight decay of the matrices, AdamW's and Muon's (not norms nor tables)."""
    beta1: float = setting(0.9, group="optimisation")
    """AdamW's first-moment decay."""
    beta2: float = setting(0.95, group="optimisation")
    """AdamW's second-moment decay."""
    clip: float = setting(1.0, group="optimisation")
    """Gradient-norm clip (0 turns it off)."""
    optimizer: str = setting("adamw", choices=OPTIMIZERS, group="optimisation",
                             default_text="muon (adamw at --tp > 1 and under "
                             "--sharding fsdp)")
    """adamw, or muon: zero1.Muon for the blocks' matrices, AdamW for the embeddings, the head
    and the vectors (lab2_trainer.recipe.muon)."""
    muon_lr: float | None = setting(None, group="optimisation", default_text=f"{MUON_LR:g}")
    """Muon's peak learning rate (--optimizer muon), on --lr's warm-up and cosine."""
    precision: str = setting(AUTO, choices=(AUTO, *PRECISIONS), group="optimisation",
                             default_text="auto: bf16 on a CUDA device with bf16, else fp32")
    """Autocast precision of the forward pass; "auto" leaves it to the device. fp8: bf16,
    with the blocks' matrix products in float8 (torchao; a GPU of compute capability 8.9+)."""
    fp8_recipe: str = setting("tensorwise", choices=FP8_RECIPES, group="optimisation")
    """With --precision fp8, the float8 scales: "tensorwise" (one a tensor; fastest) or
    "rowwise" (one a row; more accurate, slower). Ignored by the other precisions."""
    compile: bool | None = setting(None, group="optimisation", default_text="auto: on with a "
                                   "CUDA device with bf16, else off")
    """Compile the model with ``torch.compile`` (what --compile-scope says): --compile (or
    --compile on), --no-compile (--compile off), or --compile auto, which leaves it to the
    device."""
    compile_scope: str = setting("blocks", choices=COMPILE_SCOPES, group="optimisation")
    """What --compile compiles: "blocks" (regional compilation: each block on its own, one
    graph serving every block, and the embedding and the head; compiles in seconds) or
    "model" (the whole model as one graph, compiling every block's copy)."""
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
    seed: int = setting(0, group="optimisation")
    """Seed of the weights, the data order, the samples and the dropout masks (each
    data-parallel rank draws its own)."""
    nproc: int | None = setting(None, group="parallelism",
                                default_text="2 on CPU, 1 on GPU; ignored under torchrun")
    """Local ranks to spawn."""
    ddp: str | None = setting(None, choices=DDP_KINDS, group="parallelism",
                              default_text="none with zero1, zero2, zero3 and fsdp (they average "
                              "gradients themselves); else bucketed with >1 rank, else none")
    """Gradient averaging wrapper: minddp's bucketed, individual, flat or naive; PyTorch's
    DistributedDataParallel (torch); none (one rank, or a sharding that averages
    gradients itself). Only --sharding none, zero1-allreduce and torch take one."""
    bucket_mb: float = setting(25.0, group="parallelism")
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
    wrapper + PyTorch's ZeroRedundancyOptimizer), zero3 (zero1.shard_model: the parameters
    sharded too, each block a unit gathered with prefetch, zero1.Stage3Optimizer over the
    shards), fsdp (PyTorch's FSDP2 fully_shard on every block and the root, plain AdamW
    over the sharded parameters), or none."""
    tp: int = setting(1, group="parallelism", metavar="N")
    """Tensor-parallel ranks (minitp): each block's attention heads and feed-forward width,
    and the vocabulary of the embedding and the head, split over N adjacent ranks. The ranks
    are a dp x tp mesh, tensor-parallel ranks innermost; --sharding and --ddp act over the
    data-parallel ranks. 1: none. Checkpoints hold the whole tensors: they resume at any --tp."""
    sequence_parallel: bool = setting(False, group="parallelism")
    """With --tp > 1: the norms and the residual stream work on each rank's slice of the
    sequence (all-gathers and reduce-scatters where plain tensor parallelism all-reduces:
    the same bytes, 1/tp of the activations outside the matrix products)."""
    reshard_after_forward: bool = setting(True, group="parallelism")
    """--sharding zero3 and fsdp: free each block's gathered parameters after its forward
    and gather them again for backward (FSDP2's default); off keeps them to the block's
    backward (one all-gather per step, ZeRO-2's volume, more memory). Ignored by the other
    kinds."""
    device: str = setting("auto", group="parallelism")
    """auto, cpu or cuda."""
    timeout: float = setting(300.0, group="parallelism", metavar="SECONDS")
    """How long a collective waits for the other ranks, and how long a rank may go silent,
    before the run fails naming it."""
    out: str = setting("runs/latest", group="outputs", default_text="runs/<preset>-<time>")
    """Output folder."""
    resume: str | None = setting(None, group="outputs", nargs="?", const="", metavar="PATH",
                                 default_text="no")
    """Continue from a checkpoint (a run folder or its ckpt/ folder: the newest complete
    step there; a ckpt/step-N folder; or a single file of lab2-train export; alone: --out's,
    or the newest under runs/), with every setting of its run unless a flag gives it."""
    ckpt_every: int = setting(0, group="outputs", default_text="at the end")
    """Checkpoint every N steps (into <out>/ckpt/step-N/, every rank writing its part)."""
    keep_last: int = setting(1, group="outputs", metavar="K")
    """Complete checkpoints kept in <out>/ckpt/ (0: all)."""
    ckpt_async: bool = setting(True, group="outputs")
    """Write checkpoints in the background while training goes on (the step waits only
    for a copy to CPU memory)."""
    ckpt_threads: int = setting(8, group="outputs", metavar="N")
    """Threads (and files) each rank writes its part of a checkpoint with; the manifest's
    checksums are taken by as many."""
    eval_every: int = setting(50, group="outputs")
    """Validate every N steps (0: only at the end)."""
    eval_batches: int = setting(8, group="outputs")
    """Validation batches (of batch_size sequences) per evaluation."""
    log_every: int = setting(25, group="outputs")
    """Log line every N steps when the console is not a terminal."""
    sample_tokens: int = setting(300, group="outputs")
    """Length of the text sample generated at the end (0: none)."""
    profile_steps: str | None = setting(None, group="outputs", metavar="A:B",
                                        default_text="none")
    """Trace training steps A to B (counted from 1, both included) with torch.profiler and
    write the trace (Chrome trace JSON: chrome://tracing, Perfetto) into the run folder,
    one file per rank."""
    quiet: bool = setting(False, group="outputs")
    """No progress bar nor per-step console output (files are still written)."""
    plot: bool = setting(True, group="outputs")
    """Draw loss_curve.png at the end."""
    device_type: str = setting("cpu", choices=DEVICE_TYPES, flag=False)
    """The device the ranks run on, resolved from ``device``."""
    auto: str = setting("", flag=False)
    """The settings left to the device (of precision and compile), comma-separated, with the
    device's values: a new run (a rerun of its settings.toml too) chooses them for its own
    device; a resumed run keeps its checkpoint's values (and lists)."""

    def __post_init__(self) -> None:
        # Never "auto" once made: as on the CPU until resolve() knows the device.
        self.choose_for_device(None)

    def choose_for_device(self, bf16: bool | None, only: Any = AUTO_SETTINGS
                          ) -> TrainSettings:
        """Fill the settings left to the device ("auto", None for compile, or listed in
        ``auto``) for ``device_type``, and list them in ``auto``.

        Args:
            bf16: whether the device computes in bf16; None: not known, so only those
                still "auto" are filled, as on the CPU.
            only: the names chosen again when ``bf16`` is known (the others keep their
                values unless still "auto").
        """
        listed = self.auto.split(",") if isinstance(self.auto, str) else []
        unset = {"precision": self.precision == AUTO, "compile": self.compile is None}
        names = [n for n in AUTO_SETTINGS if n in listed or unset[n]]
        chosen = device_defaults(self.device_type, bool(bf16))
        for name in names:
            if bf16 is not None and name in only or getattr(self, name) in (AUTO, None):
                setattr(self, name, chosen[name])
        self.auto = ",".join(names)
        return self

    def resolve(self, world_size: int | None = None, device_type: str | None = None,
                bf16: bool | None = None) -> TrainSettings:
        """Fill the defaults that depend on the device and the number of ranks.

        Args:
            world_size: the ranks there are (under torchrun); None: ``nproc``, or
                :data:`DEFAULT_NPROC` of the device type.
            device_type: "cpu" or "cuda" (None: keep ``device_type``).
            bf16: whether the device computes in bf16 (:meth:`choose_for_device`).

        Raises:
            ValueError: a bad ``nproc``.
        """
        if device_type is not None:
            self.device_type = device_type
        self.choose_for_device(bf16)
        _integer(flag("nproc"), self.nproc, 1)
        if world_size is None:
            world_size = self.nproc or DEFAULT_NPROC.get(self.device_type, 1)
        self.nproc = world_size
        # The families act over the data-parallel ranks: their defaults follow those.
        self.sharding, self.ddp = default_layout(self.data_parallel_size(world_size),
                                                 self.sharding, self.ddp)
        self.fill_recipe()
        return self

    def fill_recipe(self) -> TrainSettings:
        """Fill the optimisation settings still unset from :mod:`lab2_trainer.recipe.defaults`: the
        learning rate from the model's width, the final one from it, the warm-up from the
        run's length (values of the wrong type are left for :meth:`check` to name)."""
        from lab2_trainer.recipe import defaults as recipe

        if self.lr is None and _is_number(self.model.d_model):
            self.lr = recipe.default_lr(self.model.d_model)
        if self.min_lr is None and _is_number(self.lr):
            self.min_lr = recipe.default_min_lr(self.lr)
        if self.warmup is None and _is_number(self.steps):
            self.warmup = recipe.default_warmup(self.steps)
        if self.muon_lr is None and self.optimizer == "muon" and _is_number(self.model.d_model):
            self.muon_lr = default_muon_lr(self.model.d_model)
        return self

    def data_parallel_size(self, world_size: int) -> int:
        """The data-parallel ranks among ``world_size``: ``world_size / tp`` (the world
        itself when ``tp`` does not divide it, for :meth:`check_tp` to name)."""
        return data_parallel_ranks(world_size, self.tp)

    def check(self) -> None:
        """Each setting in its range, in field order; ``ValueError`` with one line naming
        the first bad one by its flag."""
        _number(flag("stdlib_share"), self.stdlib_share, lambda v: 0 <= v < 1, "in [0, 1)")
        _integer(flag("vocab_size"), self.vocab_size, 1)
        for name in ("steps", "batch_size", "grad_accum"):
            _integer(flag(name), getattr(self, name), 1)
        _number(flag("lr"), self.lr, lambda v: v > 0, "> 0")
        _number(flag("min_lr"), self.min_lr)
        _integer(flag("warmup"), self.warmup, 0)
        _number(flag("weight_decay"), self.weight_decay, lambda v: v >= 0, ">= 0")
        for name in ("beta1", "beta2"):
            _number(flag(name), getattr(self, name), lambda v: 0 <= v < 1, "in [0, 1)")
        _number(flag("clip"), self.clip, lambda v: v >= 0, ">= 0")
        _one_of(flag("optimizer"), self.optimizer, OPTIMIZERS)
        _number(flag("muon_lr"), self.muon_lr, lambda v: v > 0, "> 0")
        _one_of(flag("precision"), self.precision, tuple(PRECISIONS))
        _one_of(flag("fp8_recipe"), self.fp8_recipe, FP8_RECIPES)
        if not isinstance(self.compile, bool):
            raise ValueError(f"{flag('compile')} must be on, off or auto, got {self.compile!r}")
        _one_of(flag("compile_scope"), self.compile_scope, COMPILE_SCOPES)
        _one_of(flag("backward_thread"), self.backward_thread, BACKWARD_THREADS)
        _one_of(flag("activation_checkpointing"), self.activation_checkpointing,
                ACTIVATION_CHECKPOINTING)
        _integer(flag("seed"), self.seed, 0, below="in [0, 2**63)", above="in [0, 2**63)")
        _integer(flag("nproc"), self.nproc, 1)
        _one_of(flag("ddp"), self.ddp, DDP_KINDS)
        _number(flag("bucket_mb"), self.bucket_mb, lambda v: v > 0, "> 0")
        _one_of(flag("bucket_rule"), self.bucket_rule, BUCKET_RULES)
        _one_of(flag("sharding"), self.sharding, SHARDING_KINDS)
        _integer(flag("tp"), self.tp, 1)
        _number(flag("timeout"), self.timeout, lambda v: 0 < v <= MAX_SECONDS,
                f"> 0 and at most {MAX_SECONDS:,.0f} (a year)")
        for name in ("ckpt_every", "eval_every", "keep_last"):
            _integer(flag(name), getattr(self, name), 0)
        _integer(flag("eval_batches"), self.eval_batches, 1)
        _integer(flag("ckpt_threads"), self.ckpt_threads, 1)
        _integer(flag("log_every"), self.log_every, 1)
        _integer(flag("sample_tokens"), self.sample_tokens, 0)
        if self.profile_steps is not None:
            first, last = step_range(flag("profile_steps"), self.profile_steps)
            if isinstance(self.steps, int) and last > self.steps:
                raise ValueError(f"{flag('profile_steps')} {self.profile_steps} ends after the "
                                 f"run's last step ({flag('steps')} {self.steps})")
        _one_of(flag("device_type"), self.device_type, DEVICE_TYPES)
        if not (isinstance(self.auto, str) and {*self.auto.split(",")} <= {"", *AUTO_SETTINGS}):
            raise ValueError(f"auto must list {' and '.join(AUTO_SETTINGS)}, got {self.auto!r}")

    def validate(self, world_size: int) -> TrainSettings:
        """Check the settings for ``world_size`` ranks (resolving what is still unset);
        ``ValueError`` with one line naming the first bad setting."""
        self.model.validate()
        if self.model.eps == 0:
            # The norms take 0 (tritonnorm's range); a run does not: RMSNorm's
            # 1 / sqrt(mean(x^2) + eps) divides by zero on a row of zeros.
            raise ValueError(f"--eps must be > 0 for training, got {self.model.eps!r}: a zero "
                             "eps divides by zero in the norm of a row of zeros")
        if self.ddp is None or self.sharding is None or self.nproc is None:
            self.resolve(world_size)
        self.choose_for_device(None)  # any set to "auto" since
        self.fill_recipe()
        self.check()
        self.check_tp(world_size)
        _refuse(muon_problem(self.optimizer, self.sharding, self.tp))
        _refuse(stdlib_share_problem(self.stdlib_share, self.data))
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"--min-lr must be in [0, --lr = {self.lr}], got {self.min_lr}")
        _refuse(layout_problem(self.sharding, self.ddp, self.precision, world_size,
                               self.data_parallel_size(world_size)))
        if self.vocab_size is not None and self.vocab_size != self.model.vocab_size:
            raise ValueError(
                f"--vocab-size {self.vocab_size} differs from the model's {self.model.vocab_size}"
            )
        return self

    def check_tp(self, world_size: int) -> None:
        """``--tp`` divides the ranks and every dimension it splits; ``ValueError`` with one
        line naming the first that it does not."""
        _refuse(tp_problem(self.model, self.tp, world_size, self.sequence_parallel))

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
