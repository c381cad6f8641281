"""Tensor (and sequence) parallelism of the trainer's Transformer, on minitp.

:func:`shard_transformer` cuts a whole :class:`~lab2_trainer.models.transformer.TransformerLM`
in place over the ranks of a tensor-parallel group; every rank of the group holds the same
whole model before (the same seed), and its own shards after:

==========================  ====================================  ========================
module                      becomes                               this rank holds
==========================  ====================================  ========================
``blocks.*.attn.qkv``       ``minitp.ColumnParallelLinear``       q, k and v rows of its
                                                                  ``n_heads / tp`` heads
``blocks.*.attn.proj``      ``minitp.RowParallelLinear``          the matching columns
``blocks.*.ffn.w1``, ``w3`` ``minitp.ColumnParallelLinear``       ``d_ff / tp`` rows
``blocks.*.ffn.w2``         ``minitp.RowParallelLinear``          ``d_ff / tp`` columns
``tok_emb``                 ``minitp.VocabParallelEmbedding``     ``vocab / tp`` rows
``lm_head``                 ``minitp.ColumnParallelLinear``       ``vocab / tp`` rows (the
                                                                  embedding's, when tied)
``pos_emb``, the norms      unchanged                             the whole tensor
==========================  ====================================  ========================

The fused ``qkv`` weight is ``[q; k; v]``, each ``[d, d]`` with one head per ``head_dim``
rows. A rank needs q, k and v of the same heads, so each of the three is cut on its own
and this rank's thirds are stacked: a local ``[3d / tp, d]`` whose output splits into this
rank's q, k and v as the whole one does (the attention module's head count becomes
``n_heads / tp``).

Each parallel region (attention, the feed-forward, the head) is entered once: minitp's copy
to the region (its backward sums the input gradient over the group), or under sequence
parallelism its gather along the sequence. Attention's fused ``qkv`` and the head are one
column layer each, which enters its region itself and overlaps the input-gradient reduction
with its weight-gradient product in backward. The feed-forward's ``w1`` and ``w3`` share
one entry, a forward pre-hook on the feed-forward, so that backward sums one input
gradient, not two; they then compute with ``F.linear``.

The head leaves each rank its slice of the vocabulary, ``[B, T, V / tp]``, and the model's
``loss_fn`` becomes ``minitp.vocab_parallel_cross_entropy``: the whole logits are never on
one rank.

**Sequence parallelism.** The residual stream between the parallel regions is this rank's
slice of the sequence, ``[B, T / tp, d]``: the embedding reduce-scatters along T (and adds
the positions of its slice), the norms work on the slice, each column layer (or the
feed-forward's entry) all-gathers along T, each row layer reduce-scatters along T, and the
head gathers along T. The whole parameters used on the slice (norm weights,
``pos_emb``) then get each rank's part of their gradient: :func:`sum_replicated_gradients`
sums them over the group once per step, after the data-parallel reduction (one all-reduce
of all of them together), where minitp's per-parameter hooks would sum each one per
micro-batch and would not survive FSDP2, which replaces the parameters.

**Clipping.** :func:`clip_grad_norm_` counts each sharded parameter's shards once over
the group and each whole parameter once: the global norm of one process.

**The whole model.** :func:`gather_shards` puts the shards back together (the layout of
the unsharded model, ``qkv`` included): for the end-of-run sample, and the tests.

**Dropout** (on the embedding and on each branch output, all of them on the residual
stream). Without sequence parallelism every rank of the group holds the whole stream and
draws the same masks from its default generators, which the ranks of a group hold in the
same state (the loop seeds them per data-parallel index: ``mesh.random_seed``;
:func:`shard_transformer` checks it with ``minitp.random.check_same_rng``): the run is one
process's, mask for mask. Under sequence parallelism each rank holds its slice of the
stream and draws masks of its own for it (``minitp.random.sharded_dropout``: a stream forked
from the shared one, or compiled, its part of the mask of the whole stream).

**Compilation** (``--compile``, after the cut): minitp's collectives are functional
collectives under ``torch.compile``, so a compiled block is one graph, its
input-gradient reductions included.

Decoding from the cut model is not supported (the logits are a slice).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lab2_trainer.config import ModelConfig
from lab2_trainer.models.transformer import TransformerLM
from lab2_trainer.parallel.mesh import Mesh
from lab2_trainer.recipe.layout import tp_shape_problem
from minitp import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_region,
    gather_from_sequence,
    vocab_parallel_cross_entropy,
)
from minitp.mappings import start_all_reduce
from minitp.random import check_same_rng, sharded_dropout

Group = dist.ProcessGroup | None
#: One gradient a data-parallel family holds: (parameter name, offset of this piece in the
#: parameter's flat view, the gradient piece).
Held = tuple[str, int, torch.Tensor]


@dataclass
class TensorLayout:
    """How a model is cut over a tensor-parallel group.

    Attributes:
        group: the tensor-parallel process group (None: the default group).
        tp: ranks in it; rank: this rank's index there.
        sequence_parallel: whether the residual stream is cut along the sequence.
        sharded: parameter name -> (dim it is cut along, parts): the tensor is ``parts``
            equal blocks along ``dim``, each cut into ``tp`` shards on its own (``qkv``: 3
            parts; everything else 1). Every other parameter is whole on every rank.
    """

    group: Group
    tp: int
    rank: int
    sequence_parallel: bool
    sharded: dict[str, tuple[int, int]] = field(default_factory=dict)

    def is_sharded(self, name: str) -> bool:
        return name in self.sharded

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of parameter ``name`` from its whole value (the whole value
        itself for a parameter that is not cut)."""
        if name not in self.sharded:
            return full
        dim, parts = self.sharded[name]
        return torch.cat([block.chunk(self.tp, dim)[self.rank]
                          for block in full.chunk(parts, dim)], dim)

    def join(self, name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The whole value of ``name`` from every rank's shard, in rank order (the inverse
        of :meth:`shard`)."""
        if name not in self.sharded:
            return shards[0]
        dim, parts = self.sharded[name]
        pieces = [s.chunk(parts, dim) for s in shards]
        return torch.cat([torch.cat([p[i] for p in pieces], dim) for i in range(parts)], dim)


def check_shardable(config: ModelConfig, tp: int, sequence_parallel: bool) -> None:
    """Refuse a model that ``tp`` ranks cannot cut (``ValueError``, one line): the run's
    own check (:func:`lab2_trainer.recipe.layout.tp_shape_problem`), for callers that bypass it."""
    problem = tp_shape_problem(config, tp, sequence_parallel)
    if problem is not None:
        raise ValueError(problem)


def shard_transformer(model: TransformerLM, group: Group = None, *,
                      sequence_parallel: bool = False) -> TensorLayout:
    """Cut ``model`` in place over ``group`` (see the module's documentation); every rank
    of the group calls it on the same whole model, before compilation and before any
    data-parallel wrapper.

    Raises:
        ValueError: sizes that the group's ranks do not divide (nothing is changed).
    """
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    check_shardable(model.config, tp, sequence_parallel)
    layout = TensorLayout(group, tp, rank, sequence_parallel)
    sp = sequence_parallel
    # w1 and w3: column layers whose input the feed-forward's pre-hook brings in (once).
    column = functools.partial(ColumnParallelLinear.from_linear, group=group,
                               sequence_parallel=sp, input_in_region=True)
    row = functools.partial(RowParallelLinear.from_linear, group=group, sequence_parallel=sp)
    enter = _enter_region(group, sp)
    for i, block in enumerate(model.blocks):
        prefix = f"blocks.{i}"
        attn, ffn = block.attn, block.ffn
        attn.qkv = _fused_column(attn.qkv, 3, layout)  # enters its region itself
        attn.proj = row(attn.proj)
        attn.n_heads //= tp
        layout.sharded[f"{prefix}.attn.qkv.weight"] = (0, 3)
        layout.sharded[f"{prefix}.attn.proj.weight"] = (1, 1)
        ffn.w1 = column(ffn.w1)
        if ffn.w3 is not None:
            ffn.w3 = column(ffn.w3)
            layout.sharded[f"{prefix}.ffn.w3.weight"] = (0, 1)
        ffn.w2 = row(ffn.w2)
        ffn.register_forward_pre_hook(enter)  # w1 and w3: one entry for both
        layout.sharded[f"{prefix}.ffn.w1.weight"] = (0, 1)
        layout.sharded[f"{prefix}.ffn.w2.weight"] = (1, 1)
    tied = model.lm_head.weight is model.tok_emb.weight
    model.tok_emb = VocabParallelEmbedding.from_embedding(model.tok_emb, group,
                                                          sequence_parallel=sp)
    model.lm_head = ColumnParallelLinear.from_linear(model.lm_head, group=group,
                                                     sequence_parallel=sp)
    if tied:  # one shard, shared again
        model.lm_head.weight = model.tok_emb.weight
    layout.sharded["tok_emb.weight"] = (0, 1)
    layout.sharded["lm_head.weight"] = (0, 1)
    model.loss_fn = functools.partial(vocab_parallel_cross_entropy, group=group)
    if sp:
        model.sequence_shard = (rank, tp)
    if model.config.dropout:
        # Replicated masks need the ranks' default generators in step; under sequence
        # parallelism each rank's slice of the stream draws its own (one function for
        # every block: a compiled block's graph serves them all).
        check_same_rng(group, model.tok_emb.weight.device)
        if sp:
            drop = functools.partial(sharded_dropout, group=group, dim=1)
            model.residual_dropout = drop
            for block in model.blocks:
                block.residual_dropout = drop
    model.sharded_by = f"tensor parallelism over {tp} ranks"
    return layout


def _fused_column(linear: nn.Linear, parts: int, layout: TensorLayout) -> ColumnParallelLinear:
    """A column-parallel layer holding this rank's shard of each of ``linear``'s ``parts``
    equal blocks of rows, stacked."""
    layer = ColumnParallelLinear(linear.in_features, linear.out_features, layout.group,
                                 bias=False, sequence_parallel=layout.sequence_parallel,
                                 device="meta")
    local = torch.cat([block.chunk(layout.tp, 0)[layout.rank]
                       for block in linear.weight.detach().chunk(parts, 0)])
    layer.weight = nn.Parameter(local.clone(), requires_grad=linear.weight.requires_grad)
    return layer


def _enter_region(group: Group, sequence_parallel: bool):
    """A forward pre-hook bringing a module's input into the parallel region: copied (its
    gradient summed over the group in backward), or gathered along the sequence (its
    gradient reduce-scattered)."""
    def hook(module: nn.Module, args: tuple) -> tuple:
        x, *rest = args
        x = gather_from_sequence(x, group, 1) if sequence_parallel else copy_to_region(x, group)
        return (x, *rest)

    return hook


# ------------------------------------------------------------------ gradients
def sum_replicated_gradients(layout: TensorLayout, held: list[Held]) -> None:
    """Under sequence parallelism, sum the gradients of the whole parameters (each rank's
    covers its slice of the sequence) over the group: one all-reduce of all of them, in
    place. The ranks of a tensor-parallel group hold the same pieces (the same
    data-parallel index, the same shapes); they are taken in (name, offset) order.
    Nothing without sequence parallelism (every rank computed the whole gradient)."""
    if not layout.sequence_parallel or layout.tp == 1:
        return
    mine = sorted(((n, s, g) for n, s, g in held if not layout.is_sharded(n)),
                  key=lambda h: h[:2])
    if not mine:
        return
    flat = torch.cat([g.reshape(-1) for _, _, g in mine])
    start_all_reduce(flat, layout.group, "backward").wait()
    offset = 0
    for _, _, g in mine:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


@torch.no_grad()
def clip_grad_norm_(layout: TensorLayout, held: list[Held], max_norm: float, *,
                    dp: int, dp_sharded: bool, device: torch.device,
                    wide: torch.dtype = torch.float32) -> torch.Tensor:
    """Clip the held gradients to a global 2-norm of ``max_norm`` (``inf``: only measure
    it); returns the norm before clipping, the same on every rank, in ``wide`` (the
    same dtype on every rank: float64 for a float64 model).

    Each rank's sum of squares counts its sharded gradients whole and its replicated ones
    divided by ``tp`` (every rank of the group holds the same), and divided by ``dp`` too
    when the data-parallel family leaves every data-parallel rank the whole averaged
    gradient (``dp_sharded`` False); one all-reduce over every rank adds them up: each
    element of the model counted once, the norm of one process.
    """
    grads = [g for _, _, g in held]
    wide = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    device = grads[0].device if grads else torch.device("cpu")
    sharded = torch.zeros((), dtype=wide, device=device)
    whole = torch.zeros((), dtype=wide, device=device)
    for name, _, g in held:
        sq = torch.linalg.vector_norm(g, dtype=wide).square()
        if layout.is_sharded(name):
            sharded += sq
        else:
            whole += sq
    total = sharded + whole / layout.tp
    if not dp_sharded:
        total /= dp
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total)  # every rank of the mesh: one scalar
    norm = total.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return norm


# ------------------------------------------------------------------ the whole model
def gather_shards(layout: TensorLayout, state: dict[str, torch.Tensor],
                  ranks: Sequence[int], device: torch.device) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict, on the CPU, on the group's first rank, from every
    rank's ``state`` (its shards, whole along any data-parallel dimension); None on the
    others. A collective over the group (``ranks``: its global ranks, in order; the
    tensors cross on ``device``, one at a time)."""
    out: dict[str, torch.Tensor] | None = {} if layout.rank == 0 else None
    for name, value in state.items():
        if not layout.is_sharded(name):
            if out is not None:
                out[name] = value.detach().to("cpu", copy=True)
            continue
        value = value.detach().to(device).contiguous()
        shards = [torch.empty_like(value) for _ in range(layout.tp)] if out is not None \
            else None
        dist.gather(value, shards, dst=ranks[0], group=layout.group)
        if out is not None:
            out[name] = layout.join(name, [s.cpu() for s in shards])
    return out


# ------------------------------------------------------------------ the step's view
class TensorParallel:
    """A data-parallel family's ``Parallel`` (``lab2_trainer.parallel.parallelize``), set
    up over the data-parallel ranks of a mesh on a model cut by :func:`shard_transformer`:
    what the training step calls, with the same methods and attributes.

    It steps as its family does, and adds what tensor parallelism needs: after the
    family's averaging (:meth:`finish`), the gradients of the whole parameters summed over
    the tensor-parallel group under sequence parallelism; clipping by the norm of one
    process (:meth:`clip_grad_norm_`); the whole model gathered from the shards
    (:meth:`full_model_state`). The optimizer state is not gathered or loaded yet.

    Args:
        inner: the family, with ``held_gradients()`` and ``dp_sharded``.
        mesh: the ranks, "dp" x "tp".
        layout: what :func:`shard_transformer` returned.
    """

    def __init__(self, inner: Any, mesh: Mesh, layout: TensorLayout) -> None:
        self.inner, self.mesh, self.layout = inner, mesh, layout
        for name in ("model", "optimizer", "forward", "eval_module", "sharding", "ddp",
                     "wrapper", "group", "dp_sharded"):
            setattr(self, name, getattr(inner, name))
        params = list(inner.model.parameters())
        self._device = params[0].device
        self._wide = (torch.float64 if any(p.dtype == torch.float64 for p in params)
                      else torch.float32)
        self._checked = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.inner.no_sync()

    def finish(self) -> None:
        self.inner.finish()
        if self.layout.sequence_parallel:
            held = self.inner.held_gradients()
            if not self._checked:
                self._check_same_pieces(held)
            sum_replicated_gradients(self.layout, held)

    def _check_same_pieces(self, held: list[Held]) -> None:
        """Once: the ranks of a tensor-parallel group hold the same pieces of the whole
        parameters (their sum pairs them up in order)."""
        mine = sorted((n, s, g.numel()) for n, s, g in held if not self.layout.is_sharded(n))
        every: list[Any] = [None] * self.layout.tp
        dist.all_gather_object(every, mine, group=self.layout.group)
        if any(other != mine for other in every):
            raise RuntimeError("the tensor-parallel ranks hold different pieces of the whole "
                               f"parameters under --sharding {self.sharding}")
        self._checked = True

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm_(self.layout, self.inner.held_gradients(), max_norm,
                               dp=self.mesh.size("dp"), dp_sharded=self.dp_sharded,
                               device=self._device, wide=self._wide)

    def held_gradients(self) -> list[Held]:
        return self.inner.held_gradients()

    @property
    def gradient_order(self) -> list[int] | None:
        return self.inner.gradient_order

    def set_gradient_order(self, order: list[int] | None) -> None:
        self.inner.set_gradient_order(order)

    def full_model_state(self, rank: int) -> dict[str, torch.Tensor] | None:
        """The whole, unsharded model's state dict on the CPU of global rank 0, None
        elsewhere: the family's state whole over the data-parallel group, then the shards
        of the tensor-parallel group of data-parallel index 0 gathered. A collective."""
        dp_index = self.mesh.coordinate("dp")
        whole = getattr(self.inner, "whole_state", None)  # FSDP2: on every rank
        state = whole() if whole is not None else self.inner.full_model_state(dp_index)
        if dp_index != 0:
            return None
        return gather_shards(self.layout, state, self.mesh.ranks("tp"), self._device)

    def full_optimizer_state(self, rank: int) -> dict | None:
        raise NotImplementedError("the optimizer state of a tensor-parallel run is not "
                                  "gathered yet")

    def load_full_optimizer_state(self, state: dict) -> None:
        raise NotImplementedError("a tensor-parallel run does not load an optimizer state "
                                  "yet")
