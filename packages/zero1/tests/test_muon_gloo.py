"""Muon (and Adafactor, and PyTorch's Muon) sharded by stages 1, 2 and 3 on Gloo ranks:
parity with one process on the full batch, the elements sent per step counted from the
collectives, where the state lives, a failing step, and checkpoints moved between world
sizes and stages.

The model mixes matrices of several shapes (one whose 7 rows no world size 2-4 divides,
a 1 × 6 one) that Muon steps with an embedding, norms and biases that AdamW steps, in a
second optimizer, as a user would. Float64 and the iteration in float64 (``ns_dtype=None``)
leave summation order as the only difference (about 1e-15).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import zero1
from lab2_testing.dist import run_ranks
from lab2bench.comm import count_collectives
from zero1 import Muon, ShardedOptimizer, Stage3Optimizer
from zero1.stage3_optimizer import piece_of

VOCAB, DIM, BATCH = 11, 6, 24  # BATCH: divisible by every world size 1-4, and by 2 micro
STEPS = 3
TOL = {torch.float64: 1e-10, torch.bfloat16: 1e-2}
SMALL_BUCKETS_MB = 300 / 2**20  # a few matrices per bucket: matrices straddle shards
MUON = {"lr": 0.05, "weight_decay": 0.1, "ns_dtype": None}
ADAMW = {"lr": 0.01, "betas": (0.8, 0.95)}


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, hidden)
        self.fc2 = nn.Linear(hidden, DIM, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(torch.tanh(self.fc1(self.norm(h))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(7), Block(10)])  # (7, 6): 7 rows, prime
        self.gate = nn.Linear(DIM, 1, bias=False)  # a tiny matrix, (1, 6)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.double()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        h = h * torch.sigmoid(self.gate(h))
        return self.head(self.norm(h))


def _split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Muon's matrices (the hidden layers' weights), and the rest for AdamW."""
    matrices = [p for name, p in model.named_parameters()
                if p.dim() == 2 and not name.startswith(("emb", "head"))]
    rest = [p for p in model.parameters() if all(p is not q for q in matrices)]
    return matrices, rest


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(700 + step)
    return (torch.randint(0, VOCAB, (BATCH, 3), generator=gen),
            torch.randint(0, VOCAB, (BATCH, 3), generator=gen))


def _loss(model, x, y, rank, world, micro=0, micros=1):
    per = BATCH // world // micros
    lo = rank * BATCH // world + micro * per
    logits = model(x[lo:lo + per])
    return F.cross_entropy(logits.flatten(0, 1), y[lo:lo + per].flatten()) / micros


def _optimizers(model: nn.Module, stage: int, matrix_cls=Muon, matrix_kwargs=None):
    matrices, rest = _split(model)
    kwargs = MUON if matrix_kwargs is None else matrix_kwargs
    if stage == 3:
        return (Stage3Optimizer(matrices, matrix_cls, **kwargs),
                Stage3Optimizer(rest, torch.optim.AdamW, **ADAMW))
    return (ShardedOptimizer(matrices, matrix_cls, stage=stage,
                             bucket_size_mb=SMALL_BUCKETS_MB, **kwargs),
            ShardedOptimizer(rest, torch.optim.AdamW, stage=stage,
                             bucket_size_mb=SMALL_BUCKETS_MB, **ADAMW))


def _train(model, opts, rank, world, steps, first=0, clip=None, micros=1):
    for step in range(first, first + steps):
        x, y = _batch(step)
        for micro in range(micros):
            last = micro == micros - 1
            with contextlib.ExitStack() as stack:
                if not last:
                    for opt in opts:
                        stack.enter_context(opt.no_sync())
                _loss(model, x, y, rank, world, micro, micros).backward()
        if clip is not None:
            for opt in opts:
                opt.clip_grad_norm_(clip)
        for opt in opts:  # both step before either clears (stage 3 shares the model's shards)
            opt.step()
        for opt in opts:
            opt.zero_grad()


def _weights(model: nn.Module, stage: int) -> dict[str, torch.Tensor]:
    if stage == 3:
        return zero1.sharding_of(model).full_state_dict(to=None)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _reference(world, steps, matrix_cls=Muon, matrix_kwargs=None, clip=None, first=0,
               saved=None):
    """One process, the full batch (the mean of the ranks' losses), plain optimizers."""
    model = Net()
    matrices, rest = _split(model)
    a = matrix_cls(matrices, **(MUON if matrix_kwargs is None else matrix_kwargs))
    b = torch.optim.AdamW(rest, **ADAMW)
    if saved is not None:
        model.load_state_dict(saved["model"])
        a.load_state_dict(saved["matrices"])
        b.load_state_dict(saved["rest"])
    for step in range(first, first + steps):
        x, y = _batch(step)
        (sum(_loss(model, x, y, r, world) for r in range(world)) / world).backward()
        if clip is not None:
            for params in (matrices, rest):
                torch.nn.utils.clip_grad_norm_(params, clip)
        a.step()
        b.step()
        a.zero_grad()
        b.zero_grad()
    return model.state_dict()


# name: stage, matrix optimizer, its kwargs, clip, micro-batches (no_sync for all but the last)
CASES: dict[str, tuple[int, Any, dict | None, float | None, int]] = {
    "stage1-clip": (1, Muon, None, 0.05, 1),
    "stage2-no-sync": (2, Muon, None, None, 2),
    "stage3-clip": (3, Muon, None, 0.05, 1),
}
if hasattr(torch.optim, "Adafactor"):  # factored statistics: state not shaped as the matrix
    CASES["stage2-adafactor"] = (2, torch.optim.Adafactor, {"lr": 0.01}, None, 1)
if hasattr(torch.optim, "Muon"):  # PyTorch's, orthogonalising in bfloat16
    CASES["stage3-torch-muon"] = (3, torch.optim.Muon, {"lr": 0.05}, None, 1)


# ---------------------------------------------------------------------------- counting
def _held_elements(opt, p: torch.Tensor, stage: int) -> int:
    """Elements of ``p`` in this rank's shard."""
    if stage == 3:
        piece = piece_of(p)
    elif opt._buckets is None:  # one rank
        return p.numel()
    else:
        piece = opt._buckets.pieces.get(id(p))
    return 0 if piece is None else piece.local.numel()


def _bytes(rank: int, world: int, stage: int) -> dict:
    """Elements sent in a steady step (the second) by Muon + AdamW and by AdamW + AdamW over
    the same split, and where each matrix lies."""
    out: dict[str, Any] = {}
    for name, cls, kwargs in (("muon", Muon, MUON), ("adamw", torch.optim.AdamW, ADAMW)):
        model = Net()
        if stage == 3:
            zero1.shard_model(model)
        opts = _optimizers(model, stage, cls, kwargs)
        with count_collectives() as counted:
            for step in range(2):
                counted.reset()
                _train(model, opts, rank, world, 1, first=step)
        matrices, _ = _split(model)
        # The owners' all-to-alls apart from the buckets' and units' collectives.
        a2a = [n for kind, n, _ in counted.calls if kind == "all_to_all_single"]
        out[name] = {"volume": counted.volume_elements - sum(a2a), "kinds": counted.by_kind(),
                     "a2a": a2a}
        if name == "muon":
            out["numels"] = [p.numel() for p in matrices]
            out["held"] = [_held_elements(opts[0], p, stage) for p in matrices]
            out["owners"] = [opts[0].owner_of(p) for p in matrices]
            out["state_numel"] = zero1.optimizer_state_numel(opts[0])
    return out


def _failing_step(rank: int, world: int, stage: int) -> dict:
    """The last rank's local step raises: it still sends its part, so the others finish."""
    model = Net()
    if stage == 3:
        zero1.shard_model(model)
    muon, _ = _optimizers(model, stage)
    if rank == world - 1:
        def broken(*args, **kwargs):
            raise RuntimeError("a broken local step")

        muon.local_optimizer.step = broken
    _loss(model, *_batch(0), rank, world).backward()
    start = time.monotonic()
    try:
        muon.step()
        error = None
    except RuntimeError as exc:
        error = str(exc)
    return {"error": error, "took": time.monotonic() - start}


def _everything(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    out: dict[str, Any] = {"parity": {}, "bytes": {}, "failing": {}}
    for name, (stage, cls, kwargs, clip, micros) in CASES.items():
        model = Net()
        if stage == 3:
            zero1.shard_model(model)
        opts = _optimizers(model, stage, cls, kwargs)
        _train(model, opts, rank, world, STEPS, clip=clip, micros=micros)
        out["parity"][name] = _weights(model, stage)
    for stage in (1, 2, 3):
        out["bytes"][stage] = _bytes(rank, world, stage)
    for stage in (2, 3):
        out["failing"][stage] = _failing_step(rank, world, stage)
    return out


def test_parity_bytes_owners_and_a_failing_step(world_size):
    results = run_ranks(_everything, world_size, timeout=300, pg_timeout=60)
    for name, (_, cls, kwargs, clip, _) in CASES.items():
        want = _reference(world_size, STEPS, cls, kwargs, clip)
        tol = TOL[torch.bfloat16] if cls is getattr(torch.optim, "Muon", None) else TOL[
            torch.float64]
        for rank, got in enumerate(results):
            for key, value in want.items():
                err = ((got["parity"][name][key] - value).norm() / value.norm()).item()
                assert err < tol, (name, rank, key, err)
    for stage in (1, 2, 3):
        per_rank = [got["bytes"][stage] for got in results]
        first = per_rank[0]
        numels, owners = first["numels"], first["owners"]
        assert all(got["owners"] == owners for got in per_rank)  # every rank agrees
        # Greedy largest first: no rank owns more than its share plus the largest matrix.
        loads = [sum(n for n, o in zip(numels, owners) if o == r) for r in range(world_size)]
        assert max(loads) <= sum(numels) / world_size + max(numels), loads
        # Muon's state (one momentum buffer per matrix) lives on the owners, once.
        assert sum(got["state_numel"] for got in per_rank) == sum(numels)
        for got in per_rank:
            # The buckets (or stage 3's gathers and reductions) send exactly what they send
            # for AdamW; Muon adds its two all-to-alls, nothing else.
            assert got["muon"]["volume"] == got["adamw"]["volume"], (stage, got)
            assert got["adamw"]["a2a"] == []
            assert len(got["muon"]["a2a"]) == (0 if world_size == 1 else 2), got["muon"]
        if world_size == 1:
            continue
        # Every element of a matrix outside its owner's shard crosses once per tensor moved:
        # the gradient in and the values out (stage 3: the values in as well).
        outside = sum(n - per_rank[o]["held"][i] for i, (n, o) in enumerate(zip(numels, owners)))
        moved = 2 if stage != 3 else 3
        assert sum(sum(got["muon"]["a2a"]) for got in per_rank) == moved * outside, stage
    for stage, failing in ((s, [got["failing"][s] for got in results]) for s in (2, 3)):
        assert failing[-1]["error"] == "a broken local step", stage
        for got in failing[:-1]:
            assert got["error"] is None and got["took"] < 30, (stage, got)  # not the timeout


# ---------------------------------------------------------------------------- checkpoints
NEXT_STAGE = {1: 2, 2: 3, 3: 1}


def _checkpoint_rank(rank: int, world: int, saved: dict | None) -> dict:
    """Without ``saved``: train each stage 3 steps and save (rank 0). With it: load each
    stage's checkpoint into the next stage and train 2 more steps."""
    torch.set_num_threads(1)
    out: dict[int, Any] = {}
    for stage in (1, 2, 3):
        target = stage if saved is None else NEXT_STAGE[stage]
        model = Net()
        if target == 3:
            zero1.shard_model(model)
        muon, adamw = _optimizers(model, target)
        if saved is None:
            _train(model, (muon, adamw), rank, world, STEPS)
            muon.consolidate_state_dict(to=0)
            adamw.consolidate_state_dict(to=0)
            weights = _weights(model, target)
            out[stage] = None if rank else {"model": weights, "matrices": muon.state_dict(),
                                            "rest": adamw.state_dict()}
            continue
        mine = saved[stage]
        wrong = {**mine["matrices"], "state": dict(mine["matrices"]["state"])}
        wrong["state"][0] = {"momentum_buffer": torch.zeros(3, 3, dtype=torch.float64)}
        refused = None
        try:  # the checks run whole, on every rank, and change nothing
            muon.load_state_dict(wrong)
        except ValueError as exc:
            refused = str(exc)
        if target == 3:
            zero1.sharding_of(model).load_full_state_dict(mine["model"])
        else:
            model.load_state_dict(mine["model"])
        muon.load_state_dict(mine["matrices"])
        adamw.load_state_dict(mine["rest"])
        _train(model, (muon, adamw), rank, world, 2, first=STEPS)
        out[stage] = {"refused": refused, "weights": _weights(model, target)}
    return out


def test_checkpoints_move_between_world_sizes_and_stages(world_size):
    """Saved at this world size by each stage, resumed by the next stage (1 → 2 → 3 → 1) at
    another (2 → 4; else → 2), in the plain optimizers' formats: training goes on as a
    plain Muon and AdamW resumed from the same files."""
    saved = run_ranks(_checkpoint_rank, world_size, None, timeout=180, pg_timeout=60)[0]
    other = 4 if world_size == 2 else 2
    resumed = run_ranks(_checkpoint_rank, other, saved, timeout=180, pg_timeout=60)
    for stage in (1, 2, 3):
        assert set(saved[stage]["matrices"]["state"]) == set(range(5))  # every matrix
        want = _reference(other, 2, first=STEPS, saved=saved[stage])
        for rank, got in enumerate(resumed):
            assert "momentum_buffer' of parameter 0 in param group 0" in got[stage]["refused"]
            for key, value in want.items():
                err = ((got[stage]["weights"][key] - value).norm() / value.norm()).item()
                assert err < TOL[torch.float64], (stage, rank, key, err)
