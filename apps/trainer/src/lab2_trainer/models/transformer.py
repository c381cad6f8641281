"""A decoder-only Transformer language model with a selectable norm layer, decoding through
a KV cache (:mod:`lab2_trainer.models.kv_cache`), and activation checkpointing of its blocks.

Pre-norm blocks (norm -> causal self-attention -> residual, norm -> feed-forward ->
residual), learned absolute positions, a final norm and a linear LM head. Options
(``ModelConfig``, all off by default): rotary positions on q and k instead of the position
table (``rope``), parameter-free RMS norm of q and k per head (``qk_norm``), a ReLU-squared
feed-forward (``ffn="relu2"``), zero-initialised residual projections (``zero_init_proj``)
and ``cap * tanh(logits / cap)`` on the logits (``logit_softcap``). Attention goes
through ``F.scaled_dot_product_attention(is_causal=True)`` so every backend PyTorch has
(flash, memory-efficient, math) is used where it applies. Dropout
(``ModelConfig.dropout``), while training, on the embedding and on each branch output.

Activation checkpointing of the blocks (``--activation-checkpointing``) is
:mod:`lab2_trainer.models.activation_checkpointing`'s; each block takes its checkpoint inside
its own forward (:meth:`Block.forward`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import checkpoint as _ckpt

from lab2_trainer.config import ModelConfig
from lab2_trainer.models.activation_checkpointing import (
    POLICY_CONTEXT,
    block_checkpointing,
    check_kind,
)
from lab2_trainer.models.kv_cache import KVCache, LayerKV
from lab2_trainer.recipe.defaults import init_stds
from tritonnorm.nn import FusedAddRMSNorm


class ReferenceRMSNorm(nn.Module):
    """RMSNorm in plain PyTorch with a hand-derived backward (``tritonnorm.RMSNormTorchFunction``).

    Its state dict (one ``weight`` of ones) is interchangeable with ``tritonnorm.RMSNorm``'s
    and ``torch.nn.RMSNorm``'s.

    Args:
        hidden_size: size of the normalised (last) dimension.
        eps: added to the mean square before the square root.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from tritonnorm import RMSNormTorchFunction

        return RMSNormTorchFunction.apply(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def make_norm(kind: str, dim: int, eps: float = 1e-5) -> nn.Module:
    """Build the norm layer named by ``kind``.

    Args:
        kind: "tritonnorm" (``tritonnorm.nn.FusedAddRMSNorm``: Triton kernels on CUDA,
            plain PyTorch elsewhere), "reference"
            (:class:`ReferenceRMSNorm`), "torch" (``torch.nn.RMSNorm``) or "layernorm".
        dim: normalised size.
        eps: epsilon.
    """
    if kind == "tritonnorm":
        return FusedAddRMSNorm(dim, eps=eps)
    if kind == "reference":
        return ReferenceRMSNorm(dim, eps=eps)
    if kind == "torch":
        return nn.RMSNorm(dim, eps=eps)
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps)
    raise ValueError(f"unknown norm kind {kind!r}")


def add_and_norm(norm: nn.Module, x: torch.Tensor, branch: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + branch), x + branch)``: the residual add that ends one sub-layer and the
    norm that starts the next.

    With tritonnorm's ``FusedAddRMSNorm`` both run in one Triton kernel each way, which
    saves a read and a write of the residual stream per norm. The stream ``x`` keeps its
    dtype (float32 under autocast) when the branch output is half precision. ``branch``
    None (the first block while decoding) is a plain norm.
    """
    if isinstance(norm, FusedAddRMSNorm):
        # Under autocast the next layer casts the norm's output to the autocast dtype
        # anyway: tritonnorm writes it in that dtype directly (no cast kernel, no extra
        # pass over y forward or backward).
        out_dtype = _autocast_dtype(x)
        if branch is None:
            return norm(x, out_dtype=out_dtype), x
        return norm(x, branch, out_dtype=out_dtype)
    if branch is not None:
        x = x + branch
    return norm(x), x


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast computes matrix products in on x's device, None when it is off."""
    kind = x.device.type
    if not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


#: A dropout of ``(x, p, training)``, as ``F.dropout``.
Dropout = Callable[[torch.Tensor, float, bool], torch.Tensor]


def _dropout(x: torch.Tensor, p: float, training: bool, drop: Dropout = F.dropout
             ) -> torch.Tensor:
    """``drop(x, p, training)`` where it drops something: at rate 0 the graph holds no
    dropout op."""
    return drop(x, p, training) if p and training else x


def rms_normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` divided by its root mean square over the last dimension (no weight), computed
    in float32 at least, returned in ``x``'s dtype."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_angles(start: int, length: int, head_dim: int, base: float = 10000.0, device=None,
                dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """The cosines and the sines of the rotary angles of positions ``start .. start +
    length - 1``, each ``(length, head_dim / 2)``: column ``i`` is the angle
    ``p * base ** (-2 i / head_dim)``. Computed in ``dtype`` on ``device``."""
    half = head_dim // 2
    inv_freq = base ** (-torch.arange(half, device=device, dtype=dtype) / half)
    pos = torch.arange(start, start + length, device=device, dtype=dtype)
    angle = pos[:, None] * inv_freq[None, :]
    return angle.cos(), angle.sin()


def rope_table(length: int, head_dim: int, base: float = 10000.0, device=None,
               dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """:func:`rope_angles` of positions ``0 .. length - 1`` as one ``(length, head_dim)``
    table: the cosines in the first half of each row, the sines in the second."""
    return torch.cat(rope_angles(0, length, head_dim, base, device, dtype), dim=-1)


def rotate(x: torch.Tensor, start: int, table: torch.Tensor | None = None,
           base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of ``x`` (B, heads, T, head_dim) at positions ``start`` on:
    the pair (x[i], x[i + head_dim / 2]) of position p turned by the angle
    ``p * base ** (-2 i / head_dim)``. Computed in float32 at least, returned in x's dtype.

    ``table``: :func:`rope_table` of at least ``start + T`` positions (made here without
    one). Passing it matters when compiled: Inductor fuses the making of the angles into
    the rotation's elementwise kernel, where each of the B x heads x T x head_dim elements
    then computes its own power, cosine and sine; from a table each loads two floats. At
    ``small`` 32 x 512 on an H100 those kernels took 11.7 of a 48.6 ms step, and the
    table makes the step 1.25x faster
    (apps/trainer/docs/benchmarks/2026-12-06-h100-rope-table.md)."""
    t = x.shape[-2]
    wide_dtype = torch.promote_types(x.dtype, torch.float32)
    if (table is not None and table.shape[0] >= start + t
            and torch.finfo(table.dtype).bits >= torch.finfo(wide_dtype).bits):
        cos, sin = table[start:start + t].to(wide_dtype).chunk(2, dim=-1)
    else:
        cos, sin = rope_angles(start, t, x.shape[-1], base, x.device, wide_dtype)
    x1, x2 = x.to(wide_dtype).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class _NoTable(nn.Module):
    """Where ``pos_emb`` stands under rope: no parameters, a ``weight`` of no rows (a
    non-persistent buffer), so code that counts ``pos_emb.weight`` counts nothing."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("weight", torch.empty(0, dim), persistent=False)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees positions <= t only.

    While ``kv`` holds a :class:`LayerKV` (set by
    :meth:`TransformerLM.forward_cached` for its duration), the input is the next tokens
    only: their keys and values are appended to the cache, and they attend to every
    position held there.

    With ``rope`` q and k are rotated by their positions: the whole sequence's (the
    projection's output holds all of it, under sequence parallelism too), or while decoding
    those after the cached ones. With ``qk_norm`` they are RMS-normalised per head first.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.rope = config.rope
        self.qk_norm_eps = config.eps if config.qk_norm else None
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.kv: LayerKV | None = None
        if self.rope:
            # The rotation's cosines and sines for the context (:func:`rope_table`), filled
            # by :meth:`reset_rope`; not part of the state dict (made from the shape). In
            # float64, so that a float64 model rotates exactly; a float32 computation
            # reads it cast, in the same kernel.
            self.register_buffer("rope_cos_sin", torch.empty(
                config.context_length, config.head_dim, dtype=torch.float64),
                persistent=False)

    def reset_rope(self) -> None:
        """Fill the rotation's table (after the module got storage on its device)."""
        if self.rope:
            table = self.rope_cos_sin
            table.copy_(rope_table(table.shape[0], table.shape[1], device=table.device,
                                   dtype=table.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Sizes from the projection's output, not from x: under tensor parallelism it holds
        # this rank's heads only (q, k and v of n_heads heads), and under sequence
        # parallelism the whole sequence where x holds this rank's slice.
        qkv = self.qkv(x)
        b, t, _ = qkv.shape
        q, k, v = qkv.chunk(3, dim=-1)
        head_dim = q.shape[-1] // self.n_heads
        # (B, T, D) -> (B, heads, T, head_dim), the layout SDPA expects.
        q, k, v = (z.view(b, t, self.n_heads, head_dim).transpose(1, 2) for z in (q, k, v))
        if self.qk_norm_eps is not None:
            q, k = rms_normalise(q, self.qk_norm_eps), rms_normalise(k, self.qk_norm_eps)
        if self.rope:
            start = 0 if self.kv is None else self.kv.owner.length
            table = self.rope_cos_sin
            q, k = rotate(q, start, table), rotate(k, start, table)
        if self.kv is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = self._attend_cached(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))

    def _attend_cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values, start = self.kv.update(k, v)
        t = q.shape[2]
        if start == 0:
            # A prefill: the usual causal attention over the new positions alone.
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True)
        if t == 1:
            # One new token sees every held position: no mask at all.
            return F.scaled_dot_product_attention(q, keys, values)
        # Several new tokens after held ones: new token i (absolute start + i) sees keys
        # up to start + i. SDPA's is_causal aligns the corners the other way (query i sees
        # key i), so the mask is spelled out.
        mask = torch.ones(t, start + t, dtype=torch.bool, device=q.device).tril(diagonal=start)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


class FeedForward(nn.Module):
    """SwiGLU (``w2(silu(w1 x) * w3 x)``), GELU (``w2(gelu(w1 x))``) or ReLU-squared
    (``w2(relu(w1 x)^2)``) feed-forward layer."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.kind = config.ffn
        self.w1 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.w2 = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.w3 = None
        if self.kind == "swiglu":
            self.w3 = nn.Linear(config.d_model, config.d_ff, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        if self.kind == "relu2":
            return self.w2(F.relu(self.w1(x)).square())
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    """One pre-norm decoder block.

    Attributes:
        checkpointing: how its forward is checkpointed while gradients are recorded:
            "none", "full" or "selective" (set by :class:`TransformerLM` from its
            ``activation_checkpointing``). The checkpoint is inside the block's forward,
            so that a compiled block (regional compilation) holds it in its graph and a
            module hook (FSDP2's) runs outside it.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm1 = make_norm(config.norm, config.d_model, config.eps)
        self.attn = CausalSelfAttention(config)
        self.norm2 = make_norm(config.norm, config.d_model, config.eps)
        self.ffn = FeedForward(config)
        self.dropout = config.dropout
        self.residual_dropout: Dropout = F.dropout
        """The dropout of the branch outputs, which join the residual stream: ``F.dropout``,
        or under sequence parallelism one that draws each rank's own masks for its slice of
        the stream (set by ``lab2_trainer.parallel.tensor``)."""
        self.checkpointing = "none"

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One block on the residual stream ``x``, to which the previous block's last
        branch output ``pending`` is still to be added (the embedding's zeros for the
        first block, or None), checkpointed as ``checkpointing`` says (:meth:`body` is
        what runs).

        Returns ``(x, pending)`` for the next block: the feed-forward output is added by
        the next norm, so every residual add fuses with a norm.
        """
        if self.checkpointing == "none" or not torch.is_grad_enabled():
            return self.body(x, pending)
        if self.checkpointing == "full":
            return _ckpt.checkpoint(self.body, x, pending, use_reentrant=False)
        return _ckpt.checkpoint(self.body, x, pending, use_reentrant=False,
                                context_fn=POLICY_CONTEXT)

    def body(self, x: torch.Tensor, pending: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's computation (:meth:`forward` without the checkpoint)."""
        h, x = add_and_norm(self.norm1, x, pending)
        drop = self.residual_dropout
        h, x = add_and_norm(self.norm2, x,
                            _dropout(self.attn(h), self.dropout, self.training, drop))
        return x, _dropout(self.ffn(h), self.dropout, self.training, drop)


class TransformerLM(nn.Module):
    """Decoder-only Transformer language model.

    Args:
        config: the model's shape (validated here).
        seed: seed of the weight initialisation; the same seed gives the same weights on
            the same device type, independent of the global random state.
        device: where to build the parameters.
        activation_checkpointing: "none", "full" or "selective"
            (:func:`block_checkpointing`); an attribute of the same name, which may
            be changed later. It changes what the backward keeps, not the results.

    :meth:`compile_regions` compiles the model region by region (regional compilation):
    each block on its own, so that one compiled graph serves every block, and the
    embedding and the head as functions. Decoding (:meth:`generate`,
    :meth:`forward_cached`) always runs uncompiled.
    """

    def __init__(self, config: ModelConfig, *, seed: int = 0, device=None,
                 activation_checkpointing: str = "none") -> None:
        super().__init__()
        self.config = config.validate()
        # Built without storage, then given empty storage on the device and initialised
        # there once (reset_parameters): no default initialisation on the CPU first,
        # which took seconds per billion parameters before a run's first step.
        with torch.device("meta"):
            self._build(config)
        self.to_empty(device=device if device is not None else "cpu")
        if config.tie_embeddings:  # after to_empty, which gives each module its own tensor
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters(seed)
        self.activation_checkpointing = activation_checkpointing
        self.loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy
        """The loss of (logits [N, V], targets [N]): the mean cross-entropy. Tensor
        parallelism (``lab2_trainer.parallel.tensor``) sets the vocabulary-parallel one,
        whose logits are this rank's slice of the vocabulary."""
        self.sequence_shard = (0, 1)
        """(this rank's slice, slices) of the sequence that the residual stream holds:
        ``(0, 1)``, the whole of it, but under sequence parallelism, where the embedding
        adds the positions of its slice."""
        self.residual_dropout: Dropout = F.dropout
        """The embedding's dropout (the blocks have their own attribute of that name):
        ``F.dropout``, or under sequence parallelism one that draws each rank's own masks
        for its slice of the sequence."""
        self.sharded_by: str | None = None
        """What has cut the model's matrices in place (tensor parallelism), or None:
        decoding needs the whole model."""
        # The compiled embedding and head of compile_regions (None: the plain methods).
        self._compiled_embed: Callable | None = None
        self._compiled_head: Callable | None = None
        self.regions_compiled = False
        """Whether :meth:`compile_regions` has compiled the model."""

    def _build(self, config: ModelConfig) -> None:
        """The modules, in registration order (their storage comes later)."""
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        # Under rope no position table: a stand-in with no parameters (:class:`_NoTable`).
        self.pos_emb = (_NoTable(config.d_model) if config.rope
                        else nn.Embedding(config.context_length, config.d_model))
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm_f = make_norm(config.norm, config.d_model, config.eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    @property
    def activation_checkpointing(self) -> str:
        """What the blocks' backward recomputes (setting it sets each block's
        ``checkpointing``)."""
        return self._activation_checkpointing

    @activation_checkpointing.setter
    def activation_checkpointing(self, kind: str) -> None:
        self._activation_checkpointing = check_kind(kind)
        for i, block in enumerate(self.blocks):
            block.checkpointing = block_checkpointing(kind, i)

    def compile_regions(self, **options: Any) -> None:
        """Compile each block (``nn.Module.compile``, in place) and the embedding and the
        head (as functions) with ``torch.compile(**options)``.

        The blocks are identical modules running the same code, and dynamo guards on what
        a module holds rather than on which module it is (``nn.Module`` attributes and
        parameters are the graph's inputs), so every block runs the graph compiled for
        the first (:meth:`embed` gives the first a pending branch like the others'):
        one graph serves every depth, and compilation takes about as long for 48 blocks as
        for 1. Activation checkpointing is inside the compiled graph
        (:meth:`Block.forward`); FSDP2's and the DDP wrappers' hooks run around it.
        """
        for block in self.blocks:
            block.compile(**options)
        self._compiled_embed = torch.compile(self.embed, **options)
        self._compiled_head = torch.compile(self.head, **options)
        self.regions_compiled = True

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Initialise every weight from ``seed`` with
        :func:`lab2_trainer.recipe.defaults.init_stds`: embedding tables N(0, 0.02)
        (``embed_scale`` brings their sum to unit RMS);
        matrices N(0, 0.02), those that write into the residual stream N(0, 0.02 /
        sqrt(2 n_layers)); the LM head N(0, 0.5 / sqrt(d_model)): near-uniform logits;
        norm weights one, biases zero. The recipe's docstring says why. With
        ``zero_init_proj`` the residual projections are drawn, then zeroed (the other
        weights are those of the same seed without it)."""
        device = self.tok_emb.weight.device
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        std = init_stds(self.config.d_model, self.config.n_layers,
                        tied=self.config.tie_embeddings)
        for module in self.modules():
            if isinstance(module, CausalSelfAttention):
                module.reset_rope()
        seen: set[int] = set()
        for name, param in self.named_parameters():  # named_parameters skips tied duplicates
            if id(param) in seen:
                continue
            seen.add(id(param))
            if param.dim() == 1:
                # Norm layers: weight 1, bias 0.
                param.fill_(0.0 if name.endswith("bias") else 1.0)
                continue
            if name in ("tok_emb.weight", "pos_emb.weight"):
                role = "embedding"
            elif name == "lm_head.weight":
                role = "head"
            elif name.endswith(("attn.proj.weight", "ffn.w2.weight")):
                role = "residual"
            else:
                role = "matrix"
            param.normal_(0.0, std[role], generator=gen)
            if role == "residual" and self.config.zero_init_proj:
                param.zero_()

    def num_parameters(self, *, non_embedding: bool = False) -> int:
        """Number of parameters (tied ones counted once).

        Args:
            non_embedding: leave out the token and position tables (the usual convention
                when relating model size to compute); a tied LM head goes with them.
        """
        total = sum(p.numel() for p in self.parameters())
        if non_embedding:
            total -= self.tok_emb.weight.numel() + self.pos_emb.weight.numel()
        return total

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits for every position, and the mean cross-entropy when ``targets`` are given.

        Args:
            idx: (B, T) token ids, T <= context_length.
            targets: optional (B, T) next-token ids.

        Returns:
            ``logits`` of shape (B, T, vocab_size), or ``(logits, loss)``.
        """
        t = idx.shape[-1]
        if t > self.config.context_length:
            raise ValueError(
                f"sequence length {t} exceeds context_length {self.config.context_length}"
            )
        x, pending = (self._compiled_embed or self.embed)(idx)
        return (self._compiled_head or self.head)(*self._run_blocks(x, pending), targets)

    def embed(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token plus position embeddings of ``idx`` (B, T), positions from 0, and the
        first block's pending branch: zeros.

        The zeros are shaped, typed and record gradients as every later block's pending
        branch does (a feed-forward output: the autocast dtype, gradients when the stream
        records them), so that the first block runs the same code on the same kinds of
        inputs as the others: compiled block by block, one graph serves every block, the
        first included, and one block's graph is compiled rather than two. They are
        ``x * 0`` for that (a new tensor of zeros would record no gradients inside a
        compiled graph); adding them changes no value.
        """
        x = _dropout(self._embedding(idx, 0), self.config.dropout, self.training,
                     self.residual_dropout)
        return x, (x * 0).to(_autocast_dtype(x) or x.dtype)

    def _embedding(self, idx: torch.Tensor, start: int) -> torch.Tensor:
        """Token plus position embeddings of ``idx`` (B, T) at positions ``start`` on,
        times ``embed_scale`` (no position table under rope: attention rotates q and k)."""
        if self.config.rope:
            return self.tok_emb(idx) * self.config.embed_scale
        pos = torch.arange(start, start + idx.shape[-1], device=idx.device)
        index, slices = self.sequence_shard
        if slices > 1:
            pos = pos.chunk(slices)[index]
        return (self.tok_emb(idx) + self.pos_emb(pos)) * self.config.embed_scale

    def head(self, x: torch.Tensor, pending: torch.Tensor, targets: torch.Tensor | None):
        """The final norm (adding the last block's ``pending`` branch), the LM head, and
        with ``targets`` the mean cross-entropy: :meth:`forward`'s return value."""
        logits = self.softcap(self.lm_head(add_and_norm(self.norm_f, x, pending)[0]))
        if targets is None:
            return logits
        # Cross-entropy in float32 even under autocast: the log-softmax over the
        # vocabulary is where half precision loses the most (a float64 model keeps
        # float64).
        wide = logits if logits.dtype == torch.float64 else logits.float()
        loss = self.loss_fn(wide.flatten(0, -2), targets.flatten())
        return logits, loss

    def softcap(self, logits: torch.Tensor) -> torch.Tensor:
        """``cap * tanh(logits / cap)`` with ``cap = logit_softcap`` (in float32 at least),
        or the logits as they are when it is 0. Elementwise: on a tensor-parallel rank's
        slice of the vocabulary it is the whole logits' cap, sliced."""
        cap = self.config.logit_softcap
        if not cap:
            return logits
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return cap * torch.tanh(wide / cap)

    def attention_layers(self) -> list[CausalSelfAttention]:
        """The attention modules, first layer first (what a KV cache has one entry for)."""
        return [m for m in self.modules() if isinstance(m, CausalSelfAttention)]

    def new_kv_cache(self) -> KVCache:
        """An empty cache for :meth:`forward_cached`, as long as the context window."""
        return KVCache(len(self.attention_layers()), self.config.context_length)

    @torch.no_grad()
    def forward_cached(self, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Run the next tokens ``idx`` (B, t) after the positions ``cache`` holds.

        Their keys and values join the cache and its length grows by t. On an empty cache
        this is the prefill of a prompt.

        Returns:
            The logits of the last of the t positions, (B, vocab_size).

        Raises:
            ValueError: the cache has fewer than t free positions.
        """
        self._check_whole("decode")
        t = idx.shape[-1]
        start = cache.length
        if t > cache.free:
            raise ValueError(f"{t} tokens after {start} exceed the KV cache's "
                             f"{cache.capacity} positions")
        layers = self.attention_layers()
        if len(layers) != len(cache.layers):
            raise ValueError(f"the KV cache has {len(cache.layers)} layers, the model "
                             f"{len(layers)}")
        x = self._embedding(idx, start)
        for attn, kv in zip(layers, cache.layers):
            attn.kv = kv
        try:
            # Compiled blocks run as plain code here: every new length would recompile.
            with uncompiled():
                x, pending = self._run_blocks(x)
        finally:
            for attn in layers:
                attn.kv = None
        cache.advance(t)
        last = add_and_norm(self.norm_f, x[:, -1:], pending[:, -1:])[0]
        return self.softcap(self.lm_head(last))[:, -1]

    def _run_blocks(self, x: torch.Tensor, pending: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks over the embedded input ``x`` and the first block's ``pending``
        branch (:meth:`embed`'s zeros; None: nothing to add): (residual stream, last
        block's feed-forward output, still to be added by the final norm)."""
        for block in self.blocks:
            x, pending = block(x, pending)
        return x, pending

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
    ) -> torch.Tensor:
        """Extend ``idx`` (B, T) by sampling ``max_new_tokens`` tokens one at a time.

        With ``use_cache`` (the default) the prompt's last ``context_length`` tokens are run
        once and each new token alone, against a KV cache. When the cache is full, it is
        refilled from the last ``context_length // 2`` tokens (at least one), so beyond the
        window each token is conditioned on between half a window and a whole one. Without
        the cache every token recomputes a full sliding window of the last
        ``context_length`` tokens: the same tokens as with it while the sequence fits the
        window, slower, and always a whole window of context beyond it.

        Args:
            idx: prompt token ids, (B, T) with T >= 1.
            max_new_tokens: how many tokens to add.
            temperature: logits are divided by it; 0 means greedy (argmax).
            top_k: sample only among the k most likely tokens.
            generator: random generator for the sampling (for reproducible samples).
            use_cache: decode against a KV cache (see above).

        Returns:
            (B, T + max_new_tokens) token ids.
        """
        self._check_whole("generate")
        context = self.config.context_length
        keep = max(1, context // 2)
        was_training = self.training
        self.eval()
        try:
            cache = self.new_kv_cache() if use_cache else None
            for i in range(max_new_tokens):
                if cache is None:
                    # Compiled regions run as plain code: the length changes every token.
                    with uncompiled():
                        logits = self(idx[:, -context:])[:, -1, :]
                elif i == 0:
                    logits = self.forward_cached(idx[:, -context:], cache)
                elif cache.free == 0:
                    cache.reset()
                    logits = self.forward_cached(idx[:, -keep:], cache)
                else:
                    logits = self.forward_cached(idx[:, -1:], cache)
                nxt = self._pick(logits.float(), temperature, top_k, generator)
                idx = torch.cat([idx, nxt], dim=1)
        finally:
            self.train(was_training)
        return idx

    def _check_whole(self, what: str) -> None:
        if self.sharded_by is not None:
            raise RuntimeError(f"cannot {what} with a model cut by {self.sharded_by}: its "
                               "logits are one rank's slice of the vocabulary; gather the "
                               "whole model first")

    @staticmethod
    def _pick(logits: torch.Tensor, temperature: float, top_k: int | None,
              generator: torch.Generator | None) -> torch.Tensor:
        """The next token of each row: argmax at temperature 0, else a (top-k) sample."""
        if temperature <= 0:
            return logits.argmax(dim=-1, keepdim=True)
        logits = logits / temperature
        if top_k is not None and top_k < logits.shape[-1]:
            kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = F.softmax(logits, dim=-1)
        return torch.multinomial(probs, 1, generator=generator)


def uncompiled() -> AbstractContextManager:
    """A context in which compiled functions and modules run as plain code
    (``torch.compiler.set_stance("force_eager")``; nothing on a torch without it)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def shape_model(config: Any):
    """The model with ``meta`` tensors: shapes and names only, no memory, no init."""
    class _Shapes(TransformerLM):
        def reset_parameters(self, seed: int = 0) -> None:  # nothing to fill on meta
            pass

    with torch.device("meta"):
        return _Shapes(config)
