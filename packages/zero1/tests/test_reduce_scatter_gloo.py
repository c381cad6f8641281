"""The reduce-scatter path (stages 1 and 2) on Gloo ranks against one process on the full
batch: parity, bytes sent, bytes held, checkpoints across world sizes.

Every rank trains on its slice of the batch with ``ShardedOptimizer`` averaging the
gradients itself (no DDP wrapper); the oracle is a plain optimizer in one process whose
loss is the mean of the ranks' losses. Float64 leaves summation order as the only
difference (about 1e-15); bfloat16 runs compare at that dtype's tolerance. The model has
a tied embedding, a frozen layer, a branch only rank 0 uses on even steps, and a layer
nobody uses (its ``.grad`` stays None, so the optimizer skips it, weight decay too).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lab2_testing.dist import run_ranks
from lab2bench.comm import count_collectives
from zero1 import ShardedOptimizer

BATCH, VOCAB, DIM = 24, 11, 6  # BATCH: micro-batches of 2 on 1-4 ranks
TOL = {torch.float64: 1e-10, torch.bfloat16: 3e-2}
#: A few hundred bytes per bucket: several buckets, parameters straddling ranks' shards.
SMALL_BUCKETS_MB = 400 / 2**20


class Net(nn.Module):
    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.hidden = nn.Linear(DIM, DIM)
        self.frozen = nn.Linear(DIM, DIM).requires_grad_(False)
        self.branch = nn.Linear(DIM, DIM)
        self.never = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.to(dtype)

    def forward(self, tokens: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.hidden(self.emb(tokens)))
        h = self.frozen(h)
        if use_branch:
            h = h + self.branch(h)
        return self.head(h)


def _groups(model: nn.Module) -> list[dict]:
    trainable = [p for p in model.parameters()]
    return [{"params": [p for p in trainable if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0, "lr": 0.02}]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    x = torch.randint(0, VOCAB, (BATCH, 4), generator=gen)
    return x, torch.randint(0, VOCAB, (BATCH, 4), generator=gen)


def _slice_loss(model, x, y, rank, world, step, micro=0, micros=1, autocast=False):
    """Rank ``rank``'s loss on micro-batch ``micro`` of its slice, scaled for averaging."""
    per = BATCH // world
    lo = rank * per
    m = per // micros
    xs, ys = x[lo + micro * m : lo + (micro + 1) * m], y[lo + micro * m : lo + (micro + 1) * m]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(xs, use_branch=rank == 0 and step % 2 == 0)
    # The loss in float64 (float32 under autocast): the 1/N scalings are then exact enough.
    logits = logits.float() if autocast else logits.double()
    return F.cross_entropy(logits.flatten(0, 1), ys.flatten()) / micros


def _optimizer_cls(name: str):
    return {"adamw": (torch.optim.AdamW, {"lr": 0.01, "betas": (0.8, 0.95)}),
            "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})}[name]


def _train_sharded(rank, world, case, steps, model=None, opt=None):
    dtype = torch.bfloat16 if case.get("bf16") else torch.float64
    model = model or Net(dtype=torch.float32 if case.get("autocast") else dtype)
    cls, kwargs = _optimizer_cls(case["opt"])
    opt = opt or ShardedOptimizer(_groups(model), cls, stage=case["stage"],
                                  bucket_size_mb=SMALL_BUCKETS_MB,
                                  reduce_dtype=case.get("reduce_dtype"),
                                  collectives=case.get("collectives", "auto"), **kwargs)
    norms = []
    for step in range(steps):
        x, y = _batch(step)
        micros = case.get("micros", 1)
        for micro in range(micros):
            sync = micro == micros - 1 or not case.get("no_sync")
            with (opt.no_sync() if not sync else torch.enable_grad()):
                _slice_loss(model, x, y, rank, world, step, micro, micros,
                            case.get("autocast", False)).backward()
        if case.get("clip"):
            norms.append(float(opt.clip_grad_norm_(case["clip"])))
        opt.step()
        opt.zero_grad()
        if step == 2:  # something rebinding parameter storage must not break the buckets
            for p in model.parameters():
                p.data = p.data.clone()
    return model, opt, norms


def _train_reference(world, case, steps):
    """One process, the full batch: the mean of every rank's slice loss."""
    dtype = torch.bfloat16 if case.get("bf16") else torch.float64
    model = Net(dtype=torch.float32 if case.get("autocast") else dtype)
    cls, kwargs = _optimizer_cls(case["opt"])
    opt = cls(_groups(model), **kwargs)
    norms = []
    for step in range(steps):
        x, y = _batch(step)
        loss = sum(_slice_loss(model, x, y, r, world, step, autocast=case.get("autocast", False))
                   for r in range(world)) / world
        loss.backward()
        if case.get("clip"):
            norms.append(float(torch.nn.utils.clip_grad_norm_(
                [p for p in model.parameters() if p.grad is not None], case["clip"])))
        opt.step()
        opt.zero_grad()
    return model, norms


CASES = {
    "stage1-adamw": {"stage": 1, "opt": "adamw"},
    "stage2-adamw": {"stage": 2, "opt": "adamw"},
    "stage1-sgd-clip": {"stage": 1, "opt": "sgd", "clip": 0.05},
    # Gloo's default is "rooted" (a reduce to each owner, a broadcast from each); "tensor"
    # is the reduce-scatter and all-gather NCCL runs.
    "stage1-tensor-accumulate": {"stage": 1, "opt": "adamw", "collectives": "tensor",
                                 "micros": 2},
    "stage2-tensor-accumulate-clip": {"stage": 2, "opt": "adamw", "collectives": "tensor",
                                      "micros": 2, "clip": 0.1},
    "stage1-tensor-bf16-reduce": {"stage": 1, "opt": "adamw", "collectives": "tensor",
                                  "reduce_dtype": torch.bfloat16, "bf16_tol": True},
    "stage2-sgd-clip": {"stage": 2, "opt": "sgd", "clip": 0.05},
    "stage1-accumulate-no-sync": {"stage": 1, "opt": "adamw", "micros": 2, "no_sync": True},
    "stage1-accumulate": {"stage": 1, "opt": "adamw", "micros": 2},
    "stage2-accumulate": {"stage": 2, "opt": "adamw", "micros": 2, "clip": 0.1},
    "stage2-accumulate-no-sync": {"stage": 2, "opt": "adamw", "micros": 2, "no_sync": True},
    "stage2-autocast-bf16": {"stage": 2, "opt": "adamw", "autocast": True},
    "stage1-bf16-reduce": {"stage": 1, "opt": "adamw", "reduce_dtype": torch.bfloat16,
                           "bf16_tol": True},
    "stage2-bf16-reduce": {"stage": 2, "opt": "adamw", "reduce_dtype": torch.bfloat16,
                           "bf16_tol": True},
}
STEPS = 5


def _locals_of(opt: ShardedOptimizer, module: nn.Module) -> list[torch.Tensor]:
    """What the local optimizer steps of ``module``'s parameters on this rank."""
    params = list(module.parameters())
    return [piece.local for pieces in opt._pieces for _, piece in pieces
            if any(piece.param is p for p in params)]


def _parity_rank(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name, case in CASES.items():
        model, opt, norms = _train_sharded(rank, world, case, STEPS)
        out[name] = {"params": [p.detach().clone() for p in model.parameters()],
                     "norms": norms,
                     "never_state": any(t in opt.state for t in _locals_of(opt, model.never))}
    return out


def test_parity_with_one_process_on_the_full_batch(world_size):
    results = run_ranks(_parity_rank, world_size, timeout=300, pg_timeout=120)
    for name, case in CASES.items():
        ref, ref_norms = _train_reference(world_size, case, STEPS)
        tol = TOL[torch.bfloat16] if case.get("autocast") or case.get("bf16_tol") else TOL[
            torch.float64]
        for rank, got in enumerate(results):
            mine = got[name]
            for p, q in zip(mine["params"], ref.parameters()):
                err = ((p.double() - q.double()).norm() / q.double().norm()).item()
                assert err < tol, (name, rank, err)
            # Every rank holds the same parameters, bitwise.
            first = results[0][name]["params"]
            assert all(torch.equal(a, b) for a, b in zip(mine["params"], first))
            assert mine["never_state"] is False, name  # nobody's gradient: never stepped
            for a, b in zip(mine["norms"], ref_norms):
                assert abs(a - b) <= tol * max(1.0, abs(b)) * 10, (name, a, b)
        assert torch.equal(results[0][name]["params"][3], Net().frozen.weight), name  # frozen


# ---------------------------------------------------------------------------- bytes sent
def _bytes_rank(rank: int, world: int) -> dict:
    """Elements sent per step by each path, counted from the collectives' sizes."""
    torch.set_num_threads(1)
    from minddp import DDPBucketed

    out = {}
    for label, stage, reduce in (("stage1-tensor", 1, True), ("stage2-tensor", 2, True),
                                 ("stage1-rooted", 1, True), ("stage2-rooted", 2, True),
                                 ("broadcast", 1, False)):
        model = Net()
        if reduce:
            forward = model
            opt = ShardedOptimizer(_groups(model), torch.optim.AdamW, stage=stage,
                                   bucket_size_mb=SMALL_BUCKETS_MB, lr=0.01,
                                   collectives=label.split("-")[1])
        else:
            forward = DDPBucketed(model, bucket_size_mb=SMALL_BUCKETS_MB)
            opt = ShardedOptimizer(_groups(model), torch.optim.AdamW, reduce_gradients=False,
                                   lr=0.01)
        x, y = _batch(0)
        with count_collectives() as counted:
            for step in range(2):
                counted.reset()
                _slice_loss(forward, x, y, rank, world, step).backward()
                if not reduce:
                    forward.finish_gradient_synchronization()
                opt.step()
                opt.zero_grad()
        trainable = [p for p in model.parameters() if p.requires_grad]
        out[label] = {"volume": counted.volume_elements, "kinds": counted.by_kind(),
                      "psi": sum(p.numel() for p in trainable), "tensors": len(trainable),
                      "frozen": model.frozen.weight.numel() + model.frozen.bias.numel(),
                      "buckets": opt.num_buckets}
    return out


def test_bytes_sent_per_step(world_size):
    """2Ψ for both stages (plus each bucket's padding to a multiple of N and one flag per
    parameter), about 3Ψ for DDP's all-reduce followed by the broadcasts."""
    for got in run_ranks(_bytes_rank, world_size, timeout=120, pg_timeout=60):
        if world_size == 1:
            assert all(v["volume"] == 0 for v in got.values()), got
            continue
        for label in ("stage1-tensor", "stage2-tensor", "stage1-rooted", "stage2-rooted"):
            v = got[label]
            flags = 2 * v["tensors"]  # one float per trainable parameter, all-reduced
            slack = 2 * v["buckets"] * (world_size - 1)  # padding, sent twice
            assert 2 * v["psi"] + flags <= v["volume"] <= 2 * v["psi"] + flags + slack, v
            if label.endswith("tensor"):
                want = {"reduce_scatter_tensor": v["buckets"],
                        "all_gather_into_tensor": v["buckets"], "all_reduce": 1}
            else:  # one reduce to and one broadcast from each rank, per bucket
                want = {"reduce": v["buckets"] * world_size,
                        "broadcast": v["buckets"] * world_size, "all_reduce": 1}
            assert v["kinds"] == want, (label, v)
        old = got["broadcast"]
        # DDPBucketed's all-reduce carries a used flag per member, and the broadcasts also
        # carry the frozen parameters (every parameter has an owner there).
        assert old["volume"] == 3 * old["psi"] + 2 * old["tensors"] + old["frozen"], old


# ---------------------------------------------------------------------------- bytes held
def _memory_rank(rank: int, world: int, stage: int, collectives: str) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)]).double()
    bucket_mb = 64 * 65 * 8 * 2 / 2**20  # about two layers a bucket
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage,
                           bucket_size_mb=bucket_mb, collectives=collectives, lr=0.01)
    x = torch.randn(8, 64, dtype=torch.float64)
    out = {}
    for _ in range(2):
        model(x).square().mean().backward()
        after_backward = opt.gradient_bytes()
        opt.step()
        out = {"after_backward": after_backward, "after_step": opt.gradient_bytes(),
               "state": opt.local_state_bytes()}
        opt.zero_grad()
    psi = sum(p.numel() for p in model.parameters())
    out.update(psi=psi, bucket_bytes=int(bucket_mb * 2**20) + 64 * 8, buckets=opt.num_buckets)
    return out


@pytest.mark.parametrize("collectives", ["tensor", "rooted"])
@pytest.mark.parametrize("stage", [1, 2])
def test_bytes_held_per_rank(world_size, stage, collectives):
    """Gradient + Adam state bytes per rank against ZeRO's formulas, within one bucket:
    stage 1 holds the full gradients and 1/N of them averaged, stage 2 only the 1/N (and
    one bucket's send buffer)."""
    for got in run_ranks(_memory_rank, world_size, stage, collectives, timeout=120,
                         pg_timeout=60):
        b, n = 8, world_size  # float64
        psi = got["psi"]
        state = got["state"]
        steps = 8 * (16 + got["buckets"] * n)  # AdamW's step counters (one per tensor)
        assert abs(state - 2 * b * psi / n) <= got["bucket_bytes"] + steps, got
        if n == 1:
            assert got["after_backward"] == b * psi, got
            continue
        if stage == 1:
            expected = b * psi + b * psi / n
        else:
            expected = b * psi / n
        for key in ("after_backward", "after_step"):
            assert expected <= got[key] <= expected + got["bucket_bytes"] + 8 * b * n, (key, got)


# ---------------------------------------------------------------------------- checkpoints
def _checkpoint_rank(rank: int, world: int, stage: int, resume: dict | None) -> dict:
    """Train 3 steps (or load ``resume`` first), then 2 more; return the state after 3."""
    torch.set_num_threads(1)
    case = {"stage": stage, "opt": "adamw"}
    model = Net()
    cls, kwargs = _optimizer_cls("adamw")
    opt = ShardedOptimizer(_groups(model), cls, stage=stage, bucket_size_mb=SMALL_BUCKETS_MB,
                           **kwargs)
    saved = None
    if resume is None:
        _train_sharded(rank, world, case, 3, model, opt)
        opt.consolidate_state_dict(to=0)
        if rank == 0:  # a copy: state_dict() holds views of the parameters, trained on below
            saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                     "optim": opt.state_dict()}
    else:
        model.load_state_dict(resume["model"])
        opt.load_state_dict(resume["optim"])
    for step in range(3, 5):
        x, y = _batch(step)
        _slice_loss(model, x, y, rank, world, step).backward()
        opt.step()
        opt.zero_grad()
    return {"saved": saved, "params": [p.detach().clone() for p in model.parameters()]}


def _resumed_plain(saved: dict, world: int) -> nn.Module:
    """A plain AdamW in one process resumed from ``saved``, trained on steps 3-4 with the
    loss of ``world`` ranks."""
    model = Net()
    model.load_state_dict(saved["model"])
    opt = torch.optim.AdamW(_groups(model), **_optimizer_cls("adamw")[1])
    opt.load_state_dict(saved["optim"])
    for step in range(3, 5):
        x, y = _batch(step)
        (sum(_slice_loss(model, x, y, r, world, step) for r in range(world)) / world).backward()
        opt.step()
        opt.zero_grad()
    return model


@pytest.mark.parametrize("stage", [1, 2])
def test_checkpoints_move_between_world_sizes_and_to_a_plain_optimizer(world_size, stage):
    first = run_ranks(_checkpoint_rank, world_size, stage, None, timeout=120, pg_timeout=60)
    saved = first[0]["saved"]
    # The format is AdamW's own: a plain AdamW loads it and carries on identically.
    for p, q in zip(first[0]["params"], _resumed_plain(saved, world_size).parameters()):
        assert ((p - q).norm() / q.norm()).item() < TOL[torch.float64]
    # Resumed at another world size (2 ranks from 1, 1 from more), it trains on the same.
    other = 2 if world_size == 1 else 1
    resumed = run_ranks(_checkpoint_rank, other, stage, saved, timeout=120, pg_timeout=60)
    for p, q in zip(resumed[0]["params"], _resumed_plain(saved, other).parameters()):
        assert ((p - q).norm() / q.norm()).item() < TOL[torch.float64]


# ---------------------------------------------------------------------------- add_param_group
def _never_and_early(model: Net) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    never = list(model.never.parameters())
    return never, [p for p in model.parameters() if all(p is not q for q in never)]


def _add_group_steps(model: Net, opt: torch.optim.Optimizer, never, slice_loss) -> None:
    """Five steps; the unused layer joins at step 2; StepLR halves the lr every 2 steps."""
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(5):
        if step == 2:
            opt.add_param_group({"params": never, "lr": 0.03})
        x, y = _batch(step)
        loss = slice_loss(x, y, step)
        if step >= 2:
            # Every rank adds the same term over its share: the same total as one process.
            loss = loss + model.never(model.emb(x[:1])).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def _add_group_rank(rank: int, world: int, stage: int) -> dict:
    """The unused layer joins mid-training; an LR scheduler edits the groups."""
    torch.set_num_threads(1)
    model = Net()
    never, early = _never_and_early(model)
    opt = ShardedOptimizer(early, torch.optim.AdamW, stage=stage,
                           bucket_size_mb=SMALL_BUCKETS_MB, lr=0.01)
    _add_group_steps(model, opt, never,
                     lambda x, y, step: _slice_loss(model, x, y, rank, world, step))
    return {"params": [p.detach().clone() for p in model.parameters()],
            "lrs": [g["lr"] for g in opt.param_groups]}


@pytest.mark.parametrize("stage", [1, 2])
def test_add_param_group_and_schedulers(world_size, stage):
    results = run_ranks(_add_group_rank, world_size, stage, timeout=120, pg_timeout=60)
    model = Net()
    never, early = _never_and_early(model)
    opt = torch.optim.AdamW(early, lr=0.01)
    _add_group_steps(model, opt, never, lambda x, y, step: sum(
        _slice_loss(model, x, y, r, world_size, step) for r in range(world_size)) / world_size)
    for got in results:
        assert got["lrs"] == [g["lr"] for g in opt.param_groups]
        for p, q in zip(got["params"], model.parameters()):
            assert ((p - q).norm() / q.norm()).item() < TOL[torch.float64]
