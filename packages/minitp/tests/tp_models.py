"""Models, plans and comparisons shared by minitp's tests (loaded by path: see ``load``).

Every size divides by 1, 2, 3 and 4 (and 12), so that one model serves each world size of
the Gloo matrix: 12 heads of 2, width 24, 48 hidden, a vocabulary of 36, 12 positions.
Everything is float64: sharded and single-process results then agree to ~1e-14, and a
tolerance of 1e-10 leaves room for summation order only.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lab2_testing.modules import load_path
from minitp import (
    ColumnParallelLinear,
    ColwiseLinear,
    LocalHeads,
    RowParallelLinear,
    RowwiseLinear,
    SequenceSplit,
    SharedInput,
    VocabEmbedding,
    VocabParallelEmbedding,
)

DTYPE = torch.float64
TOL = 1e-10
B, T, D, HEADS, FF, VOCAB = 2, 12, 24, 12, 48, 36


def load():
    """This module, by path (test modules cannot import their siblings by name)."""
    return load_path(Path(__file__), "minitp_tests_tp_models")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Norm-relative error ``|got - want| / max(|want|, 1e-3)``: relative, but absolute for
    a tensor that is zero in exact arithmetic and ~1e-17 in floating point."""
    if got.shape != want.shape:
        raise AssertionError(f"shapes differ: {tuple(got.shape)} vs {tuple(want.shape)}")
    return (got - want).norm().item() / max(want.norm().item(), 1e-3)


def seq_slice(x: torch.Tensor, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s slice of the sequence."""
    return x.chunk(world, dim=dim)[rank]


def gather(t: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Every rank's ``t`` concatenated along ``dim`` (to rebuild a sharded tensor)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def shard_dim(module: nn.Module, attr: str) -> int | None:
    """The dimension along which ``module.attr`` is cut over the ranks (None: whole)."""
    if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
        return 0
    if isinstance(module, RowParallelLinear) and attr == "weight":
        return 1
    return None


def compare_to_full(sharded: nn.Module, full: nn.Module, prefix: str,
                    grads: bool = True) -> dict[str, float]:
    """Errors of every parameter (and gradient) of ``sharded`` against ``full``, shards
    all-gathered into whole tensors first."""
    errors = {}
    full_modules = dict(full.named_modules())
    for mod_name, module in sharded.named_modules():
        for attr, p in module.named_parameters(recurse=False):
            ref = getattr(full_modules[mod_name], attr)
            dim = shard_dim(module, attr)
            name = f"{prefix}{mod_name}.{attr}"
            value = p.detach() if dim is None else gather(p.detach(), dim)
            errors[name] = rel_err(value, ref.detach())
            if grads:
                grad = p.grad if dim is None else gather(p.grad, dim)
                errors[f"{name}.grad"] = rel_err(grad, ref.grad)
    return errors


# ------------------------------------------------------------------ models
class Attention(nn.Module):
    """Causal self-attention with separate q, k, v projections; reshapes by ``n_heads``
    (divided by tp in the plan) and reads B and T from the projections. The key projection
    has no bias: its gradient would be zero but for rounding (softmax ignores a shift
    common to every key), which AdamW would blow up into steps of random sign."""

    def __init__(self, d: int = D, heads: int = HEADS) -> None:
        super().__init__()
        self.n_heads = heads
        self.q_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(3))
        self.k_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        b, t, _ = q.shape

        def heads(z: torch.Tensor) -> torch.Tensor:
            return z.view(b, t, self.n_heads, -1).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, d: int = D, ff: int = FF) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, ff), nn.Linear(ff, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm Transformer block."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(D), Attention()
        self.norm2, self.mlp = nn.LayerNorm(D), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Embedding, two blocks, a final norm, an output layer tied to the embedding."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def build(kind: type[nn.Module], seed: int = 0, **kwargs) -> nn.Module:
    """A float64 ``kind()`` initialised from ``seed`` (the same values on every rank)."""
    torch.manual_seed(seed)
    model = kind(**kwargs).to(DTYPE)
    with torch.no_grad():  # LayerNorm starts at (1, 0): perturb it so its gradients show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def block_plan(prefix: str = "") -> dict:
    """The plan of a :class:`Block` named ``prefix`` (e.g. ``"blocks.*."``)."""
    return {
        f"{prefix}norm*": SequenceSplit(),
        f"{prefix}attn": (SharedInput(), LocalHeads(("n_heads",))),
        f"{prefix}attn.[qkv]_proj": ColwiseLinear(multiple_of=D // HEADS),
        f"{prefix}attn.o_proj": RowwiseLinear(multiple_of=D // HEADS),
        f"{prefix}mlp.fc1": ColwiseLinear(),
        f"{prefix}mlp.fc2": RowwiseLinear(),
    }


def lm_plan() -> dict:
    return {"embed": VocabEmbedding(), **block_plan("blocks.*."), "norm": SequenceSplit(),
            "head": ColwiseLinear()}
