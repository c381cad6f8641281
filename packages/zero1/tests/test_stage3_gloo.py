"""ZeRO stage 3 on Gloo ranks: parity with one process on the full batch, bytes sent per
step counted from the collectives, bytes held during forward and backward, checkpoints.

Each rank trains its slice of every batch; the oracle is the plain model and optimizer on
the whole batch in this process. Float64 keeps the only difference, summation order,
near 1e-15; the bf16 cases compare with a looser, per-dtype tolerance. One launch per
world size runs every case, to keep the CI budget.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import checkpoint as ckpt

import zero1
from lab2_testing.dist import run_ranks

VOCAB, DIM, HIDDEN, LAYERS = 13, 8, 12, 3
BATCH, SEQ = 12, 5  # rows divisible by every world size 1-4
STEPS = 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class Tiny(nn.Module):
    """Embedding tied to the LM head, blocks in a ModuleList, one frozen bias."""

    def __init__(self, checkpointing: str = "none") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.blocks[1].fc1.bias.requires_grad_(False)
        self.checkpointing = checkpointing

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for i, block in enumerate(self.blocks):
            if self.checkpointing == "full" or (self.checkpointing == "every_other" and i % 2):
                x = ckpt.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.norm_f(x))


# name: optimizer, kwargs, dtype, shard_model options, clip, micro-steps, no_sync,
# checkpointing, autocast
CASES = {
    "adamw_full_ckpt": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}, torch.float64,
                        {}, 0.05, 1, False, "full", False),
    "sgd_no_reshard_no_sync": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, torch.float64,
                               {"reshard_after_forward": False}, None, 2, True, "every_other",
                               False),
    "adamw_accumulate_in_shard": (torch.optim.AdamW, {"lr": 1e-2}, torch.float64, {}, 1.0, 2,
                                  False, "none", False),
    "adamw_bf16_autocast": (torch.optim.AdamW, {"lr": 1e-2}, torch.float32, {}, None, 1, False,
                            "none", True),
    "sgd_param_dtype_bf16": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, torch.float32,
                               {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
                               None, 1, False, "none", False),
}
TOL = {torch.float64: 1e-10, torch.float32: 3e-2}


def _batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + micro)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen))


def _loss(model: nn.Module, idx: torch.Tensor, y: torch.Tensor, autocast: bool) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(idx)
    logits = logits.float() if autocast else logits
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _groups(model: nn.Module) -> list[dict]:
    decay = [p for p in model.parameters() if p.dim() > 1]
    other = [p for p in model.parameters() if p.dim() <= 1]
    return [{"params": decay}, {"params": other, "weight_decay": 0.0}]


def _train_step(model, opt, step, case, rows, clip_fn) -> float:
    _, _, _, _, clip, micro, no_sync, _, autocast = case
    total = 0.0
    for m in range(micro):
        idx, y = _batch(step, m)
        sync = (not no_sync) or m == micro - 1
        with (opt.no_sync() if not sync and hasattr(opt, "no_sync") else _null()):
            loss = _loss(model, idx[rows], y[rows], autocast) / micro
            loss.backward()
        total += loss.item()
    if clip is not None:
        clip_fn(clip)
    opt.step()
    opt.zero_grad()
    return total


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@functools.cache
def _reference(name: str, steps: int = STEPS) -> tuple[list[float], nn.Module, Any]:
    case = CASES[name]
    cls, kwargs, dtype, _, _, _, _, checkpointing, _ = case
    model = Tiny(checkpointing).to(dtype)
    opt = cls(_groups(model), **kwargs)
    clip = lambda c: torch.nn.utils.clip_grad_norm_(model.parameters(), c)  # noqa: E731
    losses = [_train_step(model, opt, s, case, slice(None), clip) for s in range(steps)]
    return losses, model, opt


# ---------------------------------------------------------------------------- on the ranks
def _counting(calls: list):
    """Patch the two collectives stage 3 moves parameters with; count their elements."""
    originals = (dist.all_gather_into_tensor, dist.reduce_scatter_tensor)

    def gather(out, inp, *a, **k):
        calls.append(("gather", out.numel()))
        return originals[0](out, inp, *a, **k)

    def scatter(out, inp, *a, **k):
        calls.append(("reduce", inp.numel()))
        return originals[1](out, inp, *a, **k)

    dist.all_gather_into_tensor, dist.reduce_scatter_tensor = gather, scatter
    return originals


def _watch_memory(model: nn.Module, sharded, seen: dict) -> list:
    """Record the gathered bytes at every leaf module's forward and at the gradient of its
    output during backward."""
    handles = []

    def note(phase):
        seen[phase] = max(seen.get(phase, 0), sharded.gathered_bytes())

    def forward_hook(module, args, out):
        note("forward")
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g: note("backward"))

    for m in model.modules():
        if not list(m.children()):
            handles.append(m.register_forward_hook(forward_hook))
    return handles


def _stage3_rank(rank: int, world_size: int) -> dict:
    out: dict = {}
    per = BATCH // world_size
    rows = slice(rank * per, (rank + 1) * per)
    for name, case in CASES.items():
        cls, kwargs, dtype, options, *_ = case
        checkpointing = case[7]
        model = zero1.shard_model(Tiny(checkpointing).to(dtype), **options)
        sharded = zero1.sharding_of(model)
        opt = zero1.Stage3Optimizer(_groups(model), cls, **kwargs)
        losses, counts, memory = [], [], {}
        for step in range(STEPS):
            calls: list = []
            handles = _watch_memory(model, sharded, memory) if step == 1 else []
            originals = _counting(calls)
            try:
                losses.append(_train_step(model, opt, step, case, rows, opt.clip_grad_norm_))
            finally:
                dist.all_gather_into_tensor, dist.reduce_scatter_tensor = originals
                for h in handles:
                    h.remove()
            counts.append(calls)
        full = sharded.full_state_dict(to=0)
        opt.consolidate_state_dict(to=0)
        saved = [full, opt.state_dict() if rank == 0 else None]
        units = [(u.is_root, u.padded, u.full.element_size(), bool(u.trainable))
                 for u in sharded.units]
        # Resume from the full checkpoint in a fresh sharded model: one more step.
        dist.broadcast_object_list(saved, src=0)
        again = zero1.shard_model(Tiny(checkpointing).to(dtype), **options)
        zero1.sharding_of(again).load_full_state_dict(saved[0])
        opt2 = zero1.Stage3Optimizer(_groups(again), cls, **kwargs)
        opt2.load_state_dict(saved[1])
        resumed = _train_step(again, opt2, STEPS, case, rows, opt2.clip_grad_norm_)
        out[name] = {"losses": losses, "full": full, "optim": saved[1], "counts": counts,
                     "memory": memory, "units": units, "resumed": resumed,
                     "shard_bytes": sharded.shard_bytes()}
    return out


# ---------------------------------------------------------------------------- the tests
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def test_stage3_parity_bytes_memory_and_checkpoints(world_size):
    results = run_ranks(_stage3_rank, world_size, timeout=240, pg_timeout=120)
    for name, case in CASES.items():
        dtype, options = case[2], case[3]
        tol = TOL[dtype]
        ref_losses, ref_model, ref_opt = _reference(name, STEPS + 1)
        got = results[0][name]
        # Every rank trains its slice; the average of the ranks' losses is the full batch's.
        for step in range(STEPS):
            mean = sum(r[name]["losses"][step] for r in results) / world_size
            assert abs(mean - ref_losses[step]) <= tol * abs(ref_losses[step]), (name, step)
        resumed = sum(r[name]["resumed"] for r in results) / world_size
        assert abs(resumed - ref_losses[STEPS]) <= tol * abs(ref_losses[STEPS]), name

        # The checkpoint is the plain model's and the plain optimizer's full format.
        ref_model3, ref_opt3 = _reference(name, STEPS)[1:]
        ref_state = ref_model3.state_dict()
        assert set(got["full"]) == set(ref_state)
        for key, value in ref_state.items():
            assert got["full"][key].shape == value.shape and got["full"][key].dtype == value.dtype
            if dtype == torch.float64:
                assert _rel(got["full"][key], value) <= tol, (name, key)
        # bf16: one norm over all parameters (a near-zero gradient's sign may differ).
        assert _rel(torch.cat([got["full"][k].reshape(-1) for k in ref_state]),
                    torch.cat([v.reshape(-1) for v in ref_state.values()])) <= tol, name
        plain = ref_opt3.state_dict()
        assert got["optim"]["param_groups"] == plain["param_groups"]
        assert set(got["optim"]["state"]) == set(plain["state"]), name  # frozen: no state
        for i, entry in plain["state"].items():
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and dtype == torch.float64:
                    assert _rel(got["optim"]["state"][i][key], value) <= tol, (name, i, key)

        # Bytes sent per step, counted from the collectives (world size 1 sends nothing).
        units = got["units"]
        psi = sum(padded for _, padded, _, _ in units)
        reduced = sum(padded for _, padded, _, trainable in units if trainable)
        regathered = 0 if options.get("reshard_after_forward") is False else sum(
            padded for root, padded, _, _ in units if not root)
        micro = case[5]  # every micro-step gathers; with no_sync only the last reduces
        reductions = 1 if case[6] else micro
        for calls in (r[name]["counts"][1] for r in results):
            if world_size == 1:
                assert calls == [], name
                continue
            gathered = sum(n for kind, n in calls if kind == "gather")
            sent = sum(n for kind, n in calls if kind == "reduce")
            assert gathered == micro * (psi + regathered), name
            assert sent == reductions * reduced, name
        if options.get("reshard_after_forward") is not False and world_size > 1:
            # 3Ψ a step: Ψ gathered twice (bar the root) and Ψ reduce-scattered.
            assert psi + regathered + reduced <= 3 * psi

        # Bytes held: the shards, plus at most the root and two more units gathered.
        for r in results:
            assert r[name]["shard_bytes"] == sum(
                padded // world_size * dtype.itemsize for _, padded, _, _ in units)
            if options.get("reshard_after_forward") is False:
                continue
            root = sum(p * s for is_root, p, s, _ in units if is_root)
            largest = max(p * s for is_root, p, s, _ in units if not is_root)
            alias = world_size == 1 and "param_dtype" not in options
            bound = 0 if alias else root + 2 * largest
            assert 0 < r[name]["memory"]["forward"] <= bound or alias, (name, r[name]["memory"])
            assert r[name]["memory"]["backward"] <= bound, (name, r[name]["memory"])
