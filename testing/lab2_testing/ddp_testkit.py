"""Models, data and training loops shared by minddp's distributed tests.

Used by the test files and by the rank programs (``lab2_testing.rank_programs``) alike.
Everything runs in float64 so that distributed and single-process training agree to
~1e-12.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minddp import DDPBucketed, DDPIndividualParameters, all_reduce_gradients, broadcast_module
from minddp.model_check import check_model_consistency

DTYPE = torch.float64
VOCAB = 11
SEQ = 5
VARIANTS = ("naive", "flat", "individual", "bucketed_tiny", "bucketed_few", "bucketed_one",
            "bucketed_reach")


class FrozenUnusedMLP(nn.Module):
    """An MLP with a frozen parameter, a parameter no forward uses, and a buffer."""

    def __init__(self, widths: tuple[int, ...] = (6, 8, 3), frozen_layer: int | None = None):
        super().__init__()
        self.register_buffer("offset", torch.randn(widths[0]))
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.frozen_scale = nn.Parameter(torch.rand(widths[-1]) + 0.5, requires_grad=False)
        self.unused = nn.Parameter(torch.randn(4))
        if frozen_layer is not None:
            self.layers[frozen_layer].requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.offset
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if i < len(self.layers) - 1:
                h = torch.tanh(h)
        return h * self.frozen_scale


class TiedLM(nn.Module):
    """Token embedding tied to the output projection."""

    def __init__(self, dim: int = 6):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.hidden = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(tokens))))


class TinyTransformer(nn.Module):
    """Embedding, learned positions, one encoder layer, final norm, head."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(0.1 * torch.randn(SEQ, dim))
        self.block = nn.TransformerEncoderLayer(
            dim, nhead=2, dim_feedforward=2 * dim, dropout=0.0, batch_first=True
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.block(self.embed(tokens) + self.pos)))


class BranchyNet(nn.Module):
    """Which parameters get gradients, and in which order, depends on the rank.

    Even ranks run ``b(a(x))`` and head ``left``; odd ranks run ``a(b(x))`` (so the
    gradient hooks fire in another order) and head ``right``. ``never`` is used by
    no rank.
    """

    def __init__(self, dim: int = 5):
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)
        self.left = nn.Linear(dim, 2)
        self.never = nn.Linear(dim, 2)
        self.right = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor, even: bool) -> torch.Tensor:
        if even:
            return self.left(torch.tanh(self.b(torch.tanh(self.a(x)))))
        return self.right(torch.tanh(self.a(torch.tanh(self.b(x)))))


def build_model(kind: str, seed: int, **kwargs: Any) -> nn.Module:
    """A fresh float64 model of ``kind``, initialised from ``seed``."""
    torch.manual_seed(seed)
    makers: dict[str, Callable[..., nn.Module]] = {
        "mlp": FrozenUnusedMLP,
        "tied": TiedLM,
        "transformer": TinyTransformer,
        "branchy": BranchyNet,
    }
    return makers[kind](**kwargs).to(DTYPE)


def make_batches(kind: str, seed: int, steps: int, size: int, **kwargs: Any) -> list[tuple]:
    """``steps`` global batches of ``size`` (inputs, targets) for ``kind``."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        if kind in ("tied", "transformer"):
            x = torch.randint(0, VOCAB, (size, SEQ), generator=g)
            y = torch.randint(0, VOCAB, (size, SEQ), generator=g)
        elif kind == "mlp":
            widths = kwargs.get("widths", (6, 8, 3))
            x = torch.randn(size, widths[0], generator=g, dtype=DTYPE)
            y = torch.randn(size, widths[-1], generator=g, dtype=DTYPE)
        else:  # branchy
            x = torch.randn(size, 5, generator=g, dtype=DTYPE)
            y = torch.randn(size, 2, generator=g, dtype=DTYPE)
        batches.append((x, y))
    return batches


def summed_loss(kind: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) over samples, so slices of any size combine exactly."""
    if kind in ("tied", "transformer"):
        return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1), reduction="sum")
    return ((out - y) ** 2).sum()


def split_bounds(split: list[int]) -> list[tuple[int, int]]:
    """[start, end) per rank for slice sizes ``split``."""
    bounds, start = [], 0
    for n in split:
        bounds.append((start, start + n))
        start += n
    return bounds


def make_optimizer(model: nn.Module) -> torch.optim.AdamW:
    # torch's own AdamW: the test harness's forkserver preloads torch._dynamo, which
    # building an optimizer imports, so ranks do not pay for that import.
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def few_buckets_mb(model: nn.Module) -> float:
    """A cap that splits the model's trainable gradients into about three buckets."""
    total = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return total / 3 / 2**20


def wrap(
    variant: str, model: nn.Module, bucket_size_mb: float | None = None
) -> tuple[nn.Module, Callable[[], None]]:
    """The callable to run forward with and the function to call after backward.

    ``bucket_size_mb`` is the cap of variant ``"bucketed"``; the other bucketed
    variants pick theirs from the model.
    """
    if variant in ("naive", "flat"):
        check_model_consistency(model)
        broadcast_module(model)
        flat = variant == "flat"
        return model, lambda: all_reduce_gradients(model, flat=flat)
    if variant == "individual":
        ddp = DDPIndividualParameters(model)
    else:
        cap = {
            "bucketed": bucket_size_mb,
            "bucketed_tiny": 1e-9,
            "bucketed_few": few_buckets_mb(model),
            "bucketed_one": None,
            # PyTorch DDP's rule: buckets close once they hold a sixth of the model.
            "bucketed_reach": few_buckets_mb(model) / 2,
        }
        rule = "reach" if variant == "bucketed_reach" else "at_most"
        ddp = DDPBucketed(model, cap[variant], bucket_rule=rule)
    return ddp, ddp.finish_gradient_synchronization


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Parameters, buffers and which gradients are None, detached and cloned."""
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
        "grad_is_none": {n: p.grad is None for n, p in model.named_parameters()},
    }


def train_distributed(
    kind: str, variant: str, rank: int, world_size: int, split: list[int], steps: int,
    seed: int, model_kwargs: dict | None = None, bucket_size_mb: float | None = None,
    set_to_none: bool = True,
) -> dict[str, Any]:
    """Train on this rank's slice of each global batch; rank r starts from its own init.

    ``set_to_none=False`` zeroes gradients in place between steps instead of dropping them
    (for the bucketed wrapper: autograd then accumulates into the bucket views).
    """
    model_kwargs = model_kwargs or {}
    model = build_model(kind, seed + 1000 * rank, **model_kwargs)  # broadcast must fix it
    runner, sync = wrap(variant, model, bucket_size_mb)
    optimizer = make_optimizer(model)
    batches = make_batches(kind, seed, steps, sum(split), **model_kwargs)
    start, end = split_bounds(split)[rank]
    scale = world_size / sum(split)  # averaging over ranks then gives the global mean
    for x, y in batches:
        optimizer.zero_grad(set_to_none=set_to_none)
        loss = summed_loss(kind, runner(x[start:end]), y[start:end]) * scale
        loss.backward()
        sync()
        optimizer.step()
    return snapshot(model)


def train_reference(
    kind: str, size: int, steps: int, seed: int, model_kwargs: dict | None = None
) -> dict[str, Any]:
    """Single-process training on each whole global batch (the oracle)."""
    model_kwargs = model_kwargs or {}
    model = build_model(kind, seed, **model_kwargs)
    optimizer = make_optimizer(model)
    for x, y in make_batches(kind, seed, steps, size, **model_kwargs):
        optimizer.zero_grad(set_to_none=True)
        (summed_loss(kind, model(x), y) / size).backward()
        optimizer.step()
    return snapshot(model)


def assert_matches(got: dict[str, Any], want: dict[str, Any], label: str, tol: float = 1e-9):
    """Every parameter and buffer within ``tol`` norm-relative error; same None grads."""
    for group in ("params", "buffers"):
        assert got[group].keys() == want[group].keys(), label
        for name, ref in want[group].items():
            err = (got[group][name] - ref).norm() / ref.norm().clamp_min(1e-30)
            assert err <= tol, f"{label}: {group[:-1]} {name} off by {err:.2e}"
    assert got["grad_is_none"] == want["grad_is_none"], label


def relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Norm-relative error of state dict ``b`` against ``a``, over all their tensors."""
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    den = sum(float(a[k].double().pow(2).sum()) for k in a)
    return (num / den) ** 0.5


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Whether two state dicts hold the same keys and bitwise equal tensors."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
