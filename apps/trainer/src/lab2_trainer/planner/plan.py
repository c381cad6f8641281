"""Predict a run's peak memory per GPU and its step time, before running it (no GPU
needed): :func:`plan`. ``lab2-train plan`` (:mod:`lab2_trainer.cli.plan`) prints it.
Everything is arithmetic on the model's shape; no torch is imported.

Memory, per GPU, item by item (:func:`memory_items`):

* **parameters, gradients, optimizer state**: fp32 weights, fp32 gradients and AdamW's two
  fp32 moments, sharded as ``--sharding`` shards them: the trainer's one formula,
  :func:`lab2_trainer.models.shapes.training_state_parts`;
* **sharding buffers**: zero1 stage 1 keeps its averaged gradient shard (4/N bytes a
  parameter) beside the full gradient buffer; zero2 one send buffer of the largest bucket;
  fsdp the gathered weights of the block running and the one prefetched; zero3
  (:func:`zero3_buffers`) the root unit's gathered weights and its full gradient, the
  blocks in flight, one block's gradient before it is packed and the send buffers of
  two reductions (full gradients of every parameter with accumulation); PyTorch's
  DistributedDataParallel its bucket copy of the gradients (DDPBucketed's flat buckets are
  the gradients themselves: the ``.grad`` are views of them); with one rank, zero1's
  ShardedOptimizer is the plain optimizer and holds nothing more;
* **half-precision weight copies**: eager autocast casts every matrix to bf16/fp16 once per
  forward and the matrix products keep the copies for the backward (2 bytes a matrix
  parameter); compiled graphs cast again in the backward instead. A checkpointed block
  keeps none: its copies exist again only while it is recomputed (one block's, beside the
  LM head's). With fp8 the blocks' float8 products keep the fp32 weight itself and cast it
  again in the backward: the head's copy alone;
* **activations**: :func:`layer_activation_bytes` per token and layer, times the layers
  and the micro-batch's tokens; the final norm and the logits (:func:`logits_bytes`); with
  ``full`` checkpointing each block keeps only its inputs, and one block's activations
  are alive again while it is recomputed;
* **allocator workspace**: a fixed amount (cuBLAS and attention workspaces) plus a fraction
  of the rest for the caching allocator's rounding and fragmentation.

Activations and gradients do not peak together when the gradients are freed after each
step (no DDP wrapper, one rank or zero2 or fsdp): autograd frees the activations as it
produces the gradients, so the larger of the two counts. Where the gradients persist
(zero1 stage 1's buffer on several ranks, the DDP wrappers' buckets) or accumulate
(``grad_accum`` > 1), both count.

Step time (:func:`step_time`): the hardware FLOPs of the rank's tokens (model FLOPs,
:func:`lab2_trainer.models.shapes.flops_per_token`'s ``6 N + 12 L d T``, plus the
recomputed forwards of checkpointing) at a fraction of the GPU's peak measured on one GPU
(:attr:`Hardware.efficiency`), with fp8 the blocks' matrix products
(:func:`float8_flops_per_token`) at a fraction of the float8 peak instead
(:attr:`Hardware.fp8_efficiency` of :attr:`Hardware.fp8_peak_tflops`, the casts and scales
included: fitted to one tensorwise run, rowwise not modelled); and the communication of
the sharding kind, from an alpha-beta model of each collective (ring volumes: all-reduce
2 (N-1)/N bytes, reduce-scatter and all-gather (N-1)/N), at NVLink's bandwidth within a
node and InfiniBand's between nodes. The collectives that run during backward (gradient
reductions, FSDP's backward gathers) hide behind the backward's compute except the last
bucket's; those after the step (zero1's and ZeroRedundancyOptimizer's parameter
gathers) are exposed; FSDP's forward gathers hide behind the forward except the first
block's. The exposed part is reported. With ``--optimizer muon``
(:mod:`lab2_trainer.planner.muon`) the step adds the Newton-Schulz iterations of the
matrices the slowest rank steps (all of them, or under zero1's and the broadcasting kinds
its owned share) at the same efficiency, and under zero1's stages the two all-to-alls that
carry each matrix whole to its owner and its new values back, exposed.

**Tensor parallelism** (``tp`` > 1, minitp's layers): the ranks are dp x tp, the tp ranks of
a group within one node. Each rank holds 1/tp of every block matrix, of the token table and
of the head (:func:`~lab2_trainer.models.shapes.rank_parameter_counts`; the position table
and the norms whole), and the sharding kind shards that over the dp ranks. Activations:
attention's and the feed-forward's inner tensors are 1/tp; the residual stream and the norms
are whole per token, or 1/tp under sequence parallelism, which keeps the two gathered inputs
of the column layers whole instead; the loss keeps 1/tp of the vocabulary. Step time: 1/tp
of the rank's dp group's FLOPs; per block and micro-batch two collectives of ``tokens x d``
in the autocast dtype forward (the row layers' all-reduces, exposed) and two backward (the
column layers' input gradients, which hide behind those layers' weight-gradient products),
plus one each for the embedding and the head; all-reduces, or under sequence parallelism
all-gathers and reduce-scatters of the same ring volume. These are predictions: no multi-GPU
run has checked them yet.

A checkpoint (:func:`lab2_trainer.models.shapes.checkpoint_bytes`): its size, and the CPU memory
each rank stages its part in; no rank gathers a full copy.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from lab2_trainer.config import ACTIVATION_CHECKPOINTING, PRECISIONS, ModelConfig, setting
from lab2_trainer.models.float8 import run_problem
from lab2_trainer.models.shapes import (
    block_matmul_parameters,
    checkpoint_bytes,
    flops_per_token,
    muon_parameter_count,
    parameter_counts,
    rank_parameter_counts,
    training_state_parts,
)
from lab2_trainer.planner.muon import muon_step
from lab2_trainer.planner.qk import qk_activation_bytes
from lab2_trainer.recipe.layout import (
    DDP_KINDS,
    SELF_REDUCING,
    SHARDING_KINDS,
    default_layout,
    tp_shape_problem,
)
from lab2_trainer.recipe.muon import OPTIMIZERS, muon_problem

GIB = 1024**3
#: Bytes per element of each precision's autocast dtype (fp32: no autocast; fp8 autocasts
#: to bf16, and its float8 products keep their bf16 inputs for the backward).
ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}


@dataclass(frozen=True)
class Hardware:
    """The machine a plan is for. Each field is a flag of ``lab2-train plan``; the
    defaults are an H200 node's, documented in the README's planner section."""

    gpu_memory_gib: float = setting(139.0, group="machine")
    """Usable memory per GPU, GiB (an H200's 141 GB)."""
    peak_tflops: float = setting(989.0, group="machine")
    """Dense bf16 peak per GPU, TFLOP/s (H100/H200 SXM)."""
    fp8_peak_tflops: float = setting(1979.0, group="machine")
    """Dense float8 peak per GPU, TFLOP/s (H100/H200 SXM)."""
    efficiency: float = setting(0.53, group="machine")
    """Fraction of the peak the hardware FLOPs reach: fitted to one run measured on one
    H200, whose step-time error is therefore in-sample (the README's planner section lists
    the out-of-sample checks)."""
    fp8_efficiency: float = setting(0.31, group="machine")
    """Fraction of --fp8-peak-tflops that --precision fp8's block products reach, their
    casts and scales included: fitted to xl 16 x 512 tensorwise compiled on one H100 (1.16x
    bf16's tokens/s, in-sample there); rowwise, 0.86x there, is not modelled."""
    nvlink_gbs: float = setting(450.0, group="machine")
    """Bandwidth per GPU and direction within a node, GB/s."""
    ib_gbits: float = setting(400.0, group="machine")
    """InfiniBand per GPU between nodes, Gb/s."""
    latency_intra_us: float = setting(10.0, group="machine")
    """Fixed cost of one collective within a node, us."""
    latency_inter_us: float = setting(20.0, group="machine")
    """Fixed cost of one collective between nodes, us."""
    overlap: float = setting(1.0, group="machine")
    """Fraction of the backward that gradient collectives can hide behind."""
    workspace_gib: float = setting(0.25, group="machine")
    """Fixed workspace in the peak (cuBLAS, attention, NCCL), GiB."""
    fragmentation: float = setting(0.05, group="machine")
    """Allocator reserve beyond the peak, fraction."""
    context_gib: float = setting(0.6, group="machine")
    """CUDA context outside the allocator, GiB."""


@dataclass
class PlanInput:
    """One run to plan.

    Attributes:
        model: the model's shape.
        batch_size: global batch in sequences (over all ranks and micro-batches).
        gpus_per_node, nodes: the world is their product.
        grad_accum: micro-batches per step on each rank.
        precision: "fp32", "bf16", "fp16" (autocast) or "fp8" (bf16, the blocks' matrix
            products in float8).
        sharding: one of ``SHARDING_KINDS`` (None: the trainer's default, zero1 with more
            than one rank, else none).
        ddp: the gradient-averaging wrapper, one of ``DDP_KINDS`` (None: the trainer's
            default, bucketed with more than one rank and a kind that takes one, else none).
        activation_checkpointing: "none", "full" or "selective".
        compile: whether the model is compiled (what the backward keeps differs).
        reshard_after_forward: zero3's and fsdp's.
        bucket_mb: the gradient buckets (DDPBucketed, zero1, zero2), MiB.
        tp: tensor-parallel ranks (within a node); the sharding acts over world / tp.
        sequence_parallel: with ``tp`` > 1, norms and residual stream on a sequence slice.
        optimizer: "adamw", or "muon" (the blocks' matrices keep one momentum buffer).
    """

    model: ModelConfig
    batch_size: int
    gpus_per_node: int = 1
    nodes: int = 1
    grad_accum: int = 1
    precision: str = "bf16"
    sharding: str | None = None
    ddp: str | None = None
    activation_checkpointing: str = "none"
    compile: bool = True
    reshard_after_forward: bool = True
    bucket_mb: float = 25.0
    tp: int = 1
    sequence_parallel: bool = False
    optimizer: str = "adamw"
    hardware: Hardware = field(default_factory=Hardware)

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def dp(self) -> int:
        """Data-parallel ranks: the ranks the sharding kind shards over."""
        return self.world_size // self.tp

    @property
    def micro_batch(self) -> int:
        """Sequences per data-parallel rank and micro-batch (every tp rank of a group runs
        the same ones)."""
        return self.batch_size // self.dp // self.grad_accum

    def validate(self) -> PlanInput:
        """Resolve the default sharding and check every field: ``ValueError`` with one
        line naming the first bad one."""
        self.model.validate()
        for name in ("batch_size", "gpus_per_node", "nodes", "grad_accum"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, "
                                 f"got {value!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}; got "
                             f"{self.precision!r}")
        self._check_tp()
        if self.precision == "fp8":  # the trainer's rule, but a micro-batch's tokens
            problem = run_problem(self.model, None, self.tp)
            if problem is not None:
                raise ValueError(problem)
        self.sharding, self.ddp = default_layout(self.dp, self.sharding, self.ddp)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}; got "
                             f"{self.optimizer!r}")
        problem = muon_problem(self.optimizer, self.sharding, self.tp)
        if problem is not None:
            raise ValueError(problem)
        if self.sharding not in SHARDING_KINDS:
            raise ValueError(f"--sharding must be one of {', '.join(SHARDING_KINDS)}; got "
                             f"{self.sharding!r}")
        if self.ddp not in DDP_KINDS:
            raise ValueError(f"--ddp must be one of {', '.join(DDP_KINDS)}; got {self.ddp!r}")
        if self.sharding in SELF_REDUCING and self.ddp != "none":
            raise ValueError(f"--sharding {self.sharding} averages gradients itself: --ddp "
                             f"must be none, not {self.ddp}")
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise ValueError("--activation-checkpointing must be one of "
                             f"{', '.join(ACTIVATION_CHECKPOINTING)}; got "
                             f"{self.activation_checkpointing!r}")
        per = self.dp * self.grad_accum
        if self.batch_size % per:
            ranks = "ranks" if self.tp == 1 else "data-parallel ranks"
            raise ValueError(f"--batch-size {self.batch_size} does not split into "
                             f"{self.dp} {ranks} x {self.grad_accum} micro-batches")
        if not (math.isfinite(self.bucket_mb) and self.bucket_mb > 0):
            raise ValueError(f"--bucket-mb must be > 0, got {self.bucket_mb!r}")
        zero_ok = ("fragmentation", "workspace_gib", "context_gib", "latency_intra_us",
                   "latency_inter_us", "overlap")
        for f in dataclasses.fields(self.hardware):
            value = getattr(self.hardware, f.name)
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0 \
                    or (value == 0 and f.name not in zero_ok):
                bound = ">= 0" if f.name in zero_ok else "> 0"
                raise ValueError(f"{flag} must be a finite number {bound}, got {value!r}")
        for name in ("efficiency", "fp8_efficiency"):
            if getattr(self.hardware, name) > 1:
                raise ValueError(f"--{name.replace('_', '-')} must be in (0, 1], got "
                                 f"{getattr(self.hardware, name)}")
        if self.hardware.overlap > 1:
            raise ValueError(f"--overlap must be in [0, 1], got {self.hardware.overlap}")
        return self

    def _check_tp(self) -> None:
        tp, m = self.tp, self.model
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"--tp must be an integer >= 1, got {tp!r}")
        if tp > 1 and self.gpus_per_node % tp:
            raise ValueError(f"--tp {tp} must divide --gpus-per-node {self.gpus_per_node}: a "
                             "tensor-parallel group talks at every layer, so it stays in a node")
        problem = tp_shape_problem(m, tp, self.sequence_parallel)
        if problem is not None:
            raise ValueError(problem)


# ------------------------------------------------------------------------ activations
def layer_activation_bytes(config: ModelConfig, precision: str, checkpointing: str = "none",
                           compiled: bool = False, tp: int = 1,
                           sequence_parallel: bool = False) -> float:
    """Bytes one block keeps for its backward, per token.

    With ``a`` the autocast dtype's size (4 in fp32) and the residual stream in fp32:

    * each norm keeps its fp32 input (the residual sum, 4 d) and its output in ``a``
      (the next matrix product's input, a d); nn.RMSNorm, which autograd differentiates op
      by op, also keeps its normalised input (4 d more);
    * attention keeps q, k and v (the qkv product, 3 a d), its output (a d; also the
      projection's input) and the log-sum-exp (4 bytes a head);
    * rotary positions and QK-norm (``rope``, ``qk_norm``;
      :func:`lab2_trainer.planner.qk.qk_activation_bytes`) add the q and k attention then
      takes, their own tensors (2 a d); with rope the output projection's input, then a
      copy of attention's output (a d); with QK-norm the fp32 copies of q and k its
      product keeps (8 d, where ``a`` is 2, eager only) and the fp32 reciprocal RMS of
      each head (8 bytes a head);
    * SwiGLU keeps w1's and w3's outputs, SiLU's output and the product (4 a d_ff); GELU
      w1's output and GELU's (2 a d_ff). Compiled, Inductor's partitioner recomputes some
      of the elementwise work: SwiGLU keeps 3 a d_ff (a fit to measured peaks: the
      README's planner section links the record), GELU is taken as eager.

    ``full``: the block's inputs only (the fp32 residual stream and the pending branch
    output, (4 + a) d). ``selective`` (the op-level policy): the inputs, and the outputs
    of the matrix products and attention: (4 + 6 a) d + 2 a d_ff (SwiGLU) or a d_ff
    (GELU) plus the log-sum-exp; the pending input is the previous block's last product,
    counted once.

    With ``tp`` > 1 (the module docstring): attention's and the feed-forward's inner
    tensors are 1/tp; what is whole per token (the residual stream, the norms, the row
    layers' outputs) is 1/tp too under ``sequence_parallel``, which keeps the column
    layers' two gathered inputs (2 a d) whole instead.
    """
    a = ACTIVATION_BYTES[precision]
    d, f = config.d_model, config.d_ff
    lse = 4 * config.n_heads / tp
    stream = 1 / tp if sequence_parallel else 1.0  # share of a whole-token tensor held
    gathered = 2 * a * d if sequence_parallel else 0.0
    if checkpointing == "full":
        return (4 + a) * d * stream
    mlp_products = (2 if config.ffn == "swiglu" else 1) * a * f / tp
    if checkpointing == "selective":
        # The inputs and the row layers' outputs are whole tokens; qkv and attention's
        # output are cut.
        return (4 + 2 * a) * d * stream + 4 * a * d / tp + mlp_products + lse + gathered
    norm_extra = 4 * d if config.norm == "torch" else 0
    norms = 2 * (4 * d + a * d + norm_extra) * stream
    attention = (3 * a * d + a * d + qk_activation_bytes(config, a, compiled)) / tp + lse
    if compiled and config.ffn == "swiglu":
        mlp = 3 * a * f / tp
    else:
        mlp = (4 if config.ffn == "swiglu" else 2) * a * f / tp
    return norms + attention + mlp + gathered


def final_activation_bytes(config: ModelConfig, precision: str,
                           checkpointing: str = "none", tp: int = 1,
                           sequence_parallel: bool = False) -> float:
    """Per token: what the final norm and the LM head keep (the fp32 residual sum, the
    normalised output in the autocast dtype; nn.RMSNorm's normalised input besides) and
    the loss's fp32 log-softmax (4 V). With ``selective`` checkpointing also the first
    block's pending branch (the embedding's zeros, ``a d``), which its checkpoint keeps as
    an input where every later block's is the previous block's kept product. Tensor
    parallelism keeps 1/tp of the vocabulary (and, under sequence parallelism, 1/tp of the
    rest; the head's gathered input whole)."""
    a = ACTIVATION_BYTES[precision]
    norm_extra = 4 * config.d_model if config.norm == "torch" else 0
    first_pending = a * config.d_model if checkpointing == "selective" else 0
    stream = 1 / tp if sequence_parallel else 1.0
    gathered = a * config.d_model if sequence_parallel else 0.0
    return (((4 + a) * config.d_model + norm_extra + first_pending) * stream + gathered
            + 4 * config.vocab_size / tp)


def logits_bytes(config: ModelConfig, precision: str, compiled: bool = False,
                 tp: int = 1) -> float:
    """Per token, the logits' transient peak beyond what :func:`final_activation_bytes`
    keeps: at the start of the backward, the log-softmax's incoming and outgoing fp32
    gradients (8 V) and the head's gradient in the autocast dtype (a V); compiled, one
    fused kernel writes the head's gradient from the saved log-softmax (a V). Tensor
    parallelism: 1/tp of the vocabulary."""
    a = ACTIVATION_BYTES[precision]
    return (a if compiled else 8 + a) * config.vocab_size / tp


# ----------------------------------------------------------------------------- memory
def memory_items(p: PlanInput) -> dict[str, float]:
    """Bytes per GPU, by item (see the module docstring); ``peak`` is their sum as the
    peak counts them, ``reserved`` adds the allocator's fragmentation."""
    c, hw = p.model, p.hardware
    counts = rank_parameter_counts(c, p.tp)
    n = counts["total"]
    N = p.dp  # the ranks the sharding kind shards over
    muon = muon_parameter_count(c) if p.optimizer == "muon" else 0  # tp 1: whole matrices
    state = training_state_parts(n, p.sharding, N, p.reshard_after_forward, muon)
    bucket = p.bucket_mb * 1024**2
    buffers = 0.0
    # With one rank zero1's ShardedOptimizer is the plain optimizer: no buckets.
    if p.sharding == "zero1" and N > 1:
        buffers = 4 * n / N
    elif p.sharding == "zero2" and N > 1:
        buffers = min(bucket, 4 * n)
    elif p.sharding == "fsdp":
        buffers = 2 * 4 * counts["block"] if p.reshard_after_forward else 0.0
    elif p.sharding == "zero3":
        buffers = zero3_buffers(p)
    elif p.ddp == "torch":  # DistributedDataParallel's bucket copy of the gradients
        buffers = 4 * n
    # Gradients that outlive the step: zero1 stage 1's full buffer (more than one rank),
    # and DDPBucketed's and DistributedDataParallel's buckets.
    persistent = (p.sharding == "zero1" and N > 1) or p.ddp in ("bucketed", "torch")
    half = p.precision != "fp32"
    casts = 0.0
    if half and not p.compile:
        cast = counts["matmul"]
        if p.precision == "fp8":  # Float8Linear keeps the fp32 weight: the head's copy alone
            cast -= c.n_layers * counts["block_matmul"]
        elif p.activation_checkpointing != "none":
            # A checkpointed block's forward saves nothing, its casts included: only the
            # block being recomputed holds its copies, beside the unchecked head's.
            cast -= (c.n_layers - 1) * counts["block_matmul"]
        casts = 2 * cast
    tokens = p.micro_batch * c.context_length
    sp = p.sequence_parallel
    per_layer = layer_activation_bytes(c, p.precision, p.activation_checkpointing, p.compile,
                                       p.tp, sp)
    final = final_activation_bytes(c, p.precision, p.activation_checkpointing, p.tp, sp)
    activations = tokens * (c.n_layers * per_layer + final)
    recompute = 0.0
    if p.activation_checkpointing != "none":
        # The block being recomputed holds its activations again, beside its gradients.
        recompute = tokens * layer_activation_bytes(c, p.precision, "none", p.compile, p.tp,
                                                    sp)
    logits = tokens * logits_bytes(c, p.precision, p.compile, p.tp)
    forward_backward = activations + recompute + logits
    gradients = state["gradients"]
    counted_grads = gradients if p.grad_accum > 1 or persistent else 0.0
    counted_acts = forward_backward
    if not counted_grads and gradients > forward_backward:
        counted_grads, counted_acts = gradients, 0.0
    workspace = hw.workspace_gib * GIB
    items = {
        "parameters": float(state["parameters"]),
        "gradients": float(gradients),
        "optimizer": float(state["optimizer"]),
        "sharding buffers": float(buffers),
        "half-precision weight copies": float(casts),
        "activations (blocks)": float(tokens * c.n_layers * per_layer),
        "activations (final norm, loss)": float(tokens * final),
        "recomputed block": float(recompute),
        "logits at backward start": float(logits),
        "workspace": float(workspace),
    }
    peak = (items["parameters"] + items["optimizer"] + buffers + casts + counted_grads
            + counted_acts + workspace)
    items["peak"] = peak
    items["counted_gradients"] = float(counted_grads)
    items["counted_activations"] = float(counted_acts)
    items["reserved"] = peak * (1 + hw.fragmentation)
    return items


def zero3_buffers(p: PlanInput) -> float:
    """Bytes zero1's stage 3 holds beyond the shards (fp32, every unit a block but the root:
    embeddings, head, final norm), at the start of the backward where activations peak:

    * the root's full gradient (4 bytes a root parameter): the LM head's arrives first,
      the embedding's last, and the root is packed once both are in;
    * the gradient of the block whose backward runs, before it is packed (4 a block
      parameter), and, on more than one rank, the send buffers of the two reductions
      kept in flight (4 each);
    * on more than one rank, the root's gathered weights, kept from the forward to the
      backward (4 a root parameter), and with ``reshard_after_forward`` the block
      running and the one prefetched (4 each; without it every block stays gathered,
      which the parameters item counts); one rank's shard is its full buffer;
    * with accumulation, ``no_sync``'s full gradient of every parameter (4 each).
    """
    counts = rank_parameter_counts(p.model, p.tp)
    root = counts["embeddings"] + counts["head"] + counts["norms"]
    block = counts["block"]
    held = 4 * root + 4 * block
    if p.dp > 1:
        held += 2 * 4 * block + 4 * root
        if p.reshard_after_forward:
            held += 2 * 4 * block
    if p.grad_accum > 1:
        held += 4 * counts["total"]
    return float(held)


def fits(p: PlanInput, items: dict[str, float] | None = None) -> bool:
    """Whether the reserved peak and the CUDA context fit the GPU's usable memory."""
    items = items if items is not None else memory_items(p)
    return items["reserved"] + p.hardware.context_gib * GIB <= p.hardware.gpu_memory_gib * GIB


def largest_micro_batch(p: PlanInput, limit: int = 1 << 16) -> int:
    """The largest per-rank micro-batch (sequences) whose plan fits; 0 when none does."""
    best, lo, hi = 0, 1, limit
    while lo <= hi:
        mid = (lo + hi) // 2
        trial = dataclasses.replace(p, batch_size=mid * p.dp * p.grad_accum)
        if fits(trial):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


# -------------------------------------------------------------------------- step time
def _collective(kind: str, nbytes: float, world: int, bandwidth: float, latency: float,
                calls: int) -> float:
    """Seconds of one collective kind over ``nbytes`` per rank, cut into ``calls`` calls:
    ring volumes at ``bandwidth`` bytes/s plus ``latency`` seconds a call (an all-to-all's
    rank sends and receives the (N-1)/N of its ``nbytes`` that other ranks hold)."""
    if world == 1 or nbytes == 0:
        return 0.0
    factor = {"all-reduce": 2.0, "reduce-scatter": 1.0, "all-gather": 1.0,
              "all-to-all": 1.0}[kind]
    return factor * (world - 1) / world * nbytes / bandwidth + calls * latency


def float8_flops_per_token(config: ModelConfig, checkpointing: str) -> float:
    """Hardware FLOPs per token of the products ``--precision fp8`` runs in float8: the
    blocks' matrices forward and backward (6 a weight), and forward again where ``full``
    checkpointing recomputes them (2 more)."""
    recomputed = config.n_layers if checkpointing == "full" else 0
    return float((6 * config.n_layers + 2 * recomputed) * block_matmul_parameters(config))


def step_time(p: PlanInput) -> dict[str, Any]:
    """Compute, communication by collective, exposed communication and the step's time,
    tokens/s, MFU, HFU and scaling efficiency (see the module docstring)."""
    c, hw, N, tp = p.model, p.hardware, p.dp, p.tp
    model_flops, hardware_flops = flops_per_token(c, p.activation_checkpointing)
    tokens_rank = p.batch_size // N * c.context_length  # the tokens of this rank's dp group
    peak = hw.peak_tflops * 1e12
    compute = tokens_rank * hardware_flops / tp / (peak * hw.efficiency)
    if p.precision == "fp8":  # the blocks' products at the float8 rate instead
        fp8 = float8_flops_per_token(c, p.activation_checkpointing)
        fp8_rate = hw.fp8_peak_tflops * 1e12 * hw.fp8_efficiency
        compute += tokens_rank * fp8 / tp * (1 / fp8_rate - 1 / (peak * hw.efficiency))
    # The forward is a third of the model's FLOPs; the backward the rest, recompute included.
    forward = compute * (model_flops / 3) / hardware_flops
    backward = compute - forward
    inter = p.nodes > 1
    bandwidth = (hw.ib_gbits / 8 if inter else hw.nvlink_gbs) * 1e9
    latency = (hw.latency_inter_us if inter else hw.latency_intra_us) * 1e-6
    n = rank_parameter_counts(c, tp)["total"]
    grad_bytes = 4.0 * n
    bucket = p.bucket_mb * 1024**2
    buckets = max(1, math.ceil(grad_bytes / bucket))
    comms: dict[str, dict[str, float]] = {}

    def add(name: str, kind: str, nbytes: float, calls: int, hides_behind: str) -> None:
        comms[name] = {"seconds": _collective(kind, nbytes, N, bandwidth, latency, calls),
                       "bytes": nbytes, "hides_behind": hides_behind}

    budget_extra: dict[str, float] = {}
    if tp > 1:
        # Two collectives of tokens x d per block and micro-batch each way, one more for
        # the embedding (forward) and the head (backward); within the node. Under sequence
        # parallelism each all-reduce is an all-gather and a reduce-scatter: the same ring
        # volume, twice the calls.
        a = ACTIVATION_BYTES[p.precision]
        calls = (2 * c.n_layers + 1) * p.grad_accum
        nbytes = calls * p.micro_batch * c.context_length * c.d_model * a
        split = 2 if p.sequence_parallel else 1
        tp_bw, tp_lat = hw.nvlink_gbs * 1e9, hw.latency_intra_us * 1e-6
        for name, hides in (("tensor-parallel forward", "none"),
                            ("tensor-parallel backward", "column weight gradients")):
            comms[name] = {"seconds": _collective("all-reduce", nbytes, tp, tp_bw, tp_lat,
                                                  split * calls),
                           "bytes": nbytes, "hides_behind": hides, "calls": calls}
        # The column layers' weight gradients (qkv, w1 and w3, the head): 2 FLOPs a weight
        # and token, this rank's 1/tp.
        ffn_in = 2 if c.ffn == "swiglu" else 1
        column = c.n_layers * (3 * c.d_model + ffn_in * c.d_ff) * c.d_model \
            + c.vocab_size * c.d_model
        budget_extra["column weight gradients"] = (
            tokens_rank * 2 * column / tp / (peak * hw.efficiency))

    s = p.sharding
    if s in ("none", "zero1-allreduce", "torch"):
        add("gradient all-reduce", "all-reduce", grad_bytes, buckets, "backward")
    if s in ("zero1", "zero2"):
        add("gradient reduce-scatter", "reduce-scatter", grad_bytes, buckets, "backward")
        add("parameter all-gather", "all-gather", grad_bytes, buckets, "none")
    if s in ("zero1-allreduce", "torch"):
        add("parameter broadcast", "all-gather", grad_bytes, 1, "none")
    if s == "fsdp":
        blocks = c.n_layers + 1
        gathers = p.grad_accum  # no_sync still gathers every micro-batch
        add("forward all-gather", "all-gather", gathers * grad_bytes, gathers * blocks,
            "forward")
        if p.reshard_after_forward:
            add("backward all-gather", "all-gather", gathers * grad_bytes, gathers * blocks,
                "backward")
        add("gradient reduce-scatter", "reduce-scatter", grad_bytes, blocks, "backward")
    if s == "zero3":
        blocks = c.n_layers + 1
        gathers = p.grad_accum  # no_sync still gathers every micro-batch
        add("forward all-gather", "all-gather", gathers * grad_bytes, gathers * blocks,
            "forward")
        if p.reshard_after_forward:  # the root stays gathered from forward to backward
            blocks_bytes = 4.0 * parameter_counts(c)["blocks"]
            add("backward all-gather", "all-gather", gathers * blocks_bytes,
                gathers * c.n_layers, "backward")
        add("gradient reduce-scatter", "reduce-scatter", grad_bytes, blocks, "backward")
    muon = muon_step(c, s, N) if p.optimizer == "muon" else None
    # Muon's iterations (bf16 on a GPU, at the model's efficiency) and its exchanges run in
    # the step, after the backward: nothing hides them (planner.muon).
    newton_schulz = muon.flops / (peak * hw.efficiency) if muon else 0.0
    for name, nbytes, _ in muon.exchanges if muon else ():
        add(name, "all-to-all", nbytes, 1, "none")
    budget = {"forward": forward * hw.overlap, "backward": backward * hw.overlap,
              **{k: v * hw.overlap for k, v in budget_extra.items()}}
    exposed = 0.0
    for name, comm in comms.items():
        t = comm["seconds"]
        where = comm["hides_behind"]
        if where == "none" or (N == 1 and "calls" not in comm):
            comm["exposed"] = t
        else:
            # The last call (bucket or block) has nothing left to hide behind.
            calls = comm.get("calls") or (
                buckets if s not in ("fsdp", "zero3") or ("reduce" in name and s == "fsdp")
                else c.n_layers + 1)
            last = t / max(1, calls)
            hidden = min(t - last, budget[where])
            budget[where] -= hidden
            comm["exposed"] = t - hidden
        exposed += comm["exposed"]
    step = compute + newton_schulz + exposed
    tokens = p.batch_size * c.context_length
    tokens_per_s = tokens / step if step > 0 else math.inf  # a step too fast for a float
    return {
        "compute_s": compute, "forward_s": forward, "backward_s": backward,
        "newton_schulz_s": newton_schulz,
        "muon": None if muon is None else {
            "matrices": muon.matrices, "owner_ranks": N if muon.owners else 1,
            "newton_schulz_flops": muon.flops, "elements": muon.elements,
            "share_of_step": newton_schulz / step if step > 0 else math.nan},
        "communication": comms,
        "communication_s": sum(x["seconds"] for x in comms.values()),
        "exposed_communication_s": exposed, "step_s": step, "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_gpu": tokens_per_s / p.world_size,
        "mfu": tokens_per_s * model_flops / (peak * p.world_size),
        "hfu": tokens_per_s * hardware_flops / (peak * p.world_size),
        "scaling_efficiency": (compute + newton_schulz) / step if step > 0 else math.nan,
        "model_flops_per_token": model_flops, "hardware_flops_per_token": hardware_flops,
        "link": ("InfiniBand" if inter else "NVLink") + f", {bandwidth / 1e9:g} GB/s",
    }


def assumptions(p: PlanInput) -> list[str]:
    """The plan's assumptions, in words, for the output."""
    hw = p.hardware
    return [
        "fp32 weights, gradients and AdamW moments (16 bytes a parameter before sharding; "
        + ("12 for the blocks' matrices, Muon's, with one momentum buffer); "
           if p.optimizer == "muon" else "); ")
        + "autocast computes in the precision's dtype",
        f"activations of {'compiled' if p.compile else 'eager'} blocks, residual stream in "
        "fp32; peak at the start of the backward (or in the optimizer step when gradients "
        "outweigh activations)",
        f"compute at {hw.efficiency:.0%} of {hw.peak_tflops:g} TFLOP/s (hardware FLOPs, "
        "recompute included; the default 53% is fitted to xl 32 x 512 compiled on one H200: "
        "an in-sample figure there, out-of-sample checks in the README)"
        + (f"; fp8: the blocks' matrix products at {hw.fp8_efficiency:.0%} of "
           f"{hw.fp8_peak_tflops:g} TFLOP/s, casts and scales included (the default 31% "
           "fitted to xl 16 x 512 tensorwise compiled on one H100, in-sample there; rowwise "
           "is slower and not modelled)" if p.precision == "fp8" else ""),
        f"ring collectives: NVLink {hw.nvlink_gbs:g} GB/s per GPU within a node, "
        f"InfiniBand {hw.ib_gbits:g} Gb/s per GPU between nodes (the slowest link sets a "
        f"ring's pace); {hw.latency_intra_us:g} / {hw.latency_inter_us:g} us a call",
        f"gradient reductions hide behind {hw.overlap:.0%} of the backward except the last "
        "bucket; post-step parameter gathers are exposed",
        *(["Muon: five Newton-Schulz iterations a matrix, 5 (4 m^2 n + 2 m^3) FLOPs for m x n "
           "(m <= n), in bf16 at the compute's efficiency, on the rank with the most (each "
           "matrix on one owner under zero1, zero2, zero3, zero1-allreduce and torch, largest "
           "first onto the least-loaded rank); zero1's stages move each owner's matrices in "
           "and out by two exposed all-to-alls; AdamW's and Muon's elementwise updates are "
           "not timed"] if p.optimizer == "muon" else []),
        f"workspace {hw.workspace_gib:g} GiB, allocator reserve {hw.fragmentation:.0%}, "
        f"CUDA context {hw.context_gib:g} GiB; {hw.gpu_memory_gib:g} GiB usable per GPU",
    ]


def plan(p: PlanInput) -> dict[str, Any]:
    """The whole prediction for ``p`` (validated here) as plain values (the JSON output)."""
    p.validate()
    items = memory_items(p)
    counts = parameter_counts(p.model)
    return {
        "model": p.model.to_dict(),
        "parameters": counts["total"],
        "world_size": p.world_size, "gpus_per_node": p.gpus_per_node, "nodes": p.nodes,
        "batch_size": p.batch_size, "micro_batch": p.micro_batch, "grad_accum": p.grad_accum,
        "precision": p.precision, "sharding": p.sharding, "ddp": p.ddp,
        "tp": p.tp, "dp": p.dp, "sequence_parallel": p.sequence_parallel,
        "activation_checkpointing": p.activation_checkpointing, "compile": p.compile,
        "memory_bytes": items,
        "peak_gib": items["peak"] / GIB,
        "reserved_gib": items["reserved"] / GIB,
        "gpu_memory_gib": p.hardware.gpu_memory_gib,
        "fits": fits(p, items),
        "largest_micro_batch": largest_micro_batch(p),
        "time": step_time(p),
        "checkpoint_bytes": checkpoint_bytes(counts["total"], p.world_size),
        "parameters_per_gpu": rank_parameter_counts(p.model, p.tp)["total"],
        "hardware": dataclasses.asdict(p.hardware),
        "assumptions": assumptions(p),
    }

