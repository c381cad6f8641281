"""ShardedOptimizer on Gloo ranks: parity with the plain optimizer, state accounting,
ranks owning nothing, the coalesced exchange, add_param_group and LR schedulers.

Each rank trains a sharded model on its slice of the batch, averaging gradients by
hand (an all_reduce, like DDP), and a plain optimizer on the full batch locally: the
oracle. Float64 keeps the only difference, summation order, near 1e-15.
"""

from __future__ import annotations

import atexit
import copy
import functools
import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from lab2_testing.dist import RankFailed, run_ranks
from zero1 import ShardedOptimizer, optimizer_state_numel

#: These ranks average gradients by hand (as a DDP wrapper would): the broadcast path.
#: The reduce-scatter path has its own tests (test_reduce_scatter_gloo.py).
Broadcasting = functools.partial(ShardedOptimizer, reduce_gradients=False)

BATCH = 12  # divisible by every world size 1-4
TOL = 1e-10  # norm-relative, float64


def _model(seed: int = 0, widths=(6, 10, 10, 3)) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i in range(len(widths) - 1):
        layers += [torch.nn.Linear(widths[i], widths[i + 1]), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1]).double()


def _two_groups(model: torch.nn.Module) -> list[dict]:
    params = list(model.parameters())
    return [
        {"params": params[:4], "lr": 0.02, "weight_decay": 0.0},
        {"params": params[4:], "lr": 0.01, "weight_decay": 0.1},
    ]


def _batch(step: int, width: int = 6, out: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, width, generator=gen, dtype=torch.float64)
    return x, torch.randn(BATCH, out, generator=gen, dtype=torch.float64)


def _loss(model, x, y) -> torch.Tensor:
    return (model(x) - y).square().mean()


def _backward_averaged(model, x, y, rank: int, world_size: int) -> torch.Tensor:
    """This rank's slice of the batch, then gradients averaged over ranks by hand."""
    per = BATCH // world_size
    loss = _loss(model, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
    loss.backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world_size)
    return loss


def _max_rel_err(model, ref) -> float:
    return max(
        ((p - q).norm() / q.norm()).item() for p, q in zip(model.parameters(), ref.parameters())
    )


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _count_broadcasts(fn):
    """Run ``fn`` with torch.distributed.broadcast counted (this process only)."""
    original, calls = dist.broadcast, [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    dist.broadcast = counting
    try:
        fn()
    finally:
        dist.broadcast = original
    return calls[0]


# ---------------------------------------------------------------------------- rank functions
SCENARIOS = [
    # name, optimizer class, defaults, use a closure, use an LR scheduler
    ("adamw", torch.optim.AdamW, {"lr": 1e-2, "betas": (0.85, 0.99)}, False, True),
    ("sgd", torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}, True, False),
    ("adam", torch.optim.Adam, {"lr": 1e-2, "weight_decay": 1e-3}, False, False),
]


def parity_rank(rank: int, world_size: int) -> dict:
    out: dict = {}
    for name, cls, kwargs, use_closure, use_sched in SCENARIOS:
        model, ref = _model(), _model()
        opt = Broadcasting(_two_groups(model), cls, **kwargs)
        plain = cls(_two_groups(ref), **kwargs)
        scheds = []
        if use_sched:
            scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.8**s) for o in (opt, plain)]
        broadcasts = []
        for step in range(12):
            x, y = _batch(step)
            if use_closure:

                def closure(x=x, y=y, opt=opt, model=model):
                    opt.zero_grad()
                    return _backward_averaged(model, x, y, rank, world_size)

                loss = opt.step(closure)
                assert isinstance(loss, torch.Tensor)
            else:
                opt.zero_grad()
                _backward_averaged(model, x, y, rank, world_size)
                broadcasts.append(_count_broadcasts(opt.step))
            plain.zero_grad()
            _loss(ref, x, y).backward()
            plain.step()
            for s in scheds:
                s.step()
            if step == 5:
                # Something rebinding parameter storage must not break the exchange.
                for p in model.parameters():
                    p.data = p.data.clone()
        if use_sched:
            assert opt.param_groups[0]["lr"] == plain.param_groups[0]["lr"] < 0.02 * 0.8**10
        owned_numel = sum(p.numel() for p in opt.state)
        out[name] = {
            "err": _max_rel_err(model, ref),
            "params": _flat(model),
            "state_numel": optimizer_state_numel(opt),
            "plain_state_numel": optimizer_state_numel(plain),
            "owned_numel": owned_numel,
            "sizes": [p.numel() for p in model.parameters()],
            "broadcasts": broadcasts,
            "expected_broadcasts": opt.broadcasts_per_step,
        }
    return out


def tiny_rank(rank: int, world_size: int) -> dict:
    """Two parameter tensors in two groups: at world sizes 3 and 4 some ranks own nothing."""
    out: dict = {}
    # Ranks passing different parameters is caught before any sharding.
    mismatched = [torch.nn.Parameter(torch.ones(2 + (rank == world_size - 1 and rank > 0)))]
    try:
        Broadcasting(mismatched, torch.optim.SGD, lr=0.1)
        out["mismatch_error"] = None
    except ValueError as err:
        out["mismatch_error"] = str(err)
    for cls, kwargs in ((torch.optim.AdamW, {"lr": 0.05}), (torch.optim.SGD, {"lr": 0.1,
                                                                              "momentum": 0.9})):
        torch.manual_seed(1)
        model = torch.nn.Linear(6, 1).double()
        ref = torch.nn.Linear(6, 1).double()
        ref.load_state_dict(model.state_dict())
        groups = lambda m: [{"params": [m.weight]}, {"params": [m.bias], "lr": 0.2}]
        opt = Broadcasting(groups(model), cls, **kwargs)
        plain = cls(groups(ref), **kwargs)
        assert len(opt.local_optimizer.param_groups) == 2
        _train_steps(model, opt, ref, plain, 10, 0, rank, world_size, out=1)
        out[cls.__name__] = {
            "err": _max_rel_err(model, ref),
            "params": _flat(model),
            "owns": len(opt.state),
            "broadcasts": opt.broadcasts_per_step,
        }
    return out


def add_group_rank(rank: int, world_size: int) -> dict:
    """Layers unfrozen mid-training join through add_param_group; StepLR edits lr."""
    out: dict = {}
    for cls, kwargs in ((torch.optim.AdamW, {"lr": 1e-2}), (torch.optim.SGD, {"lr": 0.05,
                                                                              "momentum": 0.9})):
        model, ref = _model(2), _model(2)
        late = lambda m: list(m[0].parameters())
        early = lambda m: [{"params": list(m[2].parameters()) + list(m[4].parameters())}]
        opt = Broadcasting(early(model), cls, **kwargs)
        plain = cls(early(ref), **kwargs)
        scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5) for o in (opt, plain)]
        for p in late(model) + late(ref):
            p.requires_grad_(False)
        for step in range(12):
            if step == 4:
                for p in late(model) + late(ref):
                    p.requires_grad_(True)
                opt.add_param_group({"params": late(model), "lr": 0.03})
                plain.add_param_group({"params": late(ref), "lr": 0.03})
            x, y = _batch(step)
            opt.zero_grad()
            plain.zero_grad()
            _backward_averaged(model, x, y, rank, world_size)
            _loss(ref, x, y).backward()
            opt.step()
            plain.step()
            for s in scheds:
                s.step()
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in plain.param_groups]
        out[cls.__name__] = {"err": _max_rel_err(model, ref), "params": _flat(model)}
    return out


def property_rank(rank: int, world_size: int, shape_lists: list, splits: list[int]) -> list:
    return [_property_case(shapes, split) for shapes, split in zip(shape_lists, splits)]


def _property_case(shapes: list[tuple[int, ...]], split: int) -> dict:
    """Identical gradients on every rank; parity and accounting for drawn shapes."""
    out: dict = {}
    for cls, kwargs in ((torch.optim.AdamW, {"lr": 0.1}), (torch.optim.SGD, {"lr": 0.1,
                                                                             "momentum": 0.5})):
        gen = torch.Generator().manual_seed(7)
        values = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
        params = [torch.nn.Parameter(v.clone()) for v in values]
        ref_params = [torch.nn.Parameter(v.clone()) for v in values]
        groups = lambda ps: [{"params": ps[:split]}, {"params": ps[split:], "lr": 0.05}]
        opt = Broadcasting(groups(params), cls, **kwargs)
        plain = cls(groups(ref_params), **kwargs)
        for _ in range(3):
            for p, q in zip(params, ref_params):
                p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
                q.grad = p.grad.clone()
            opt.step()
            plain.step()
        out[cls.__name__] = {
            "equal": all(torch.allclose(p, q, rtol=1e-12, atol=1e-12)
                         for p, q in zip(params, ref_params)),
            "params": torch.cat([p.detach().reshape(-1) for p in params]),
            "state_numel": optimizer_state_numel(opt),
            "plain_state_numel": optimizer_state_numel(plain),
            "owned_numel": sum(p.numel() for p in opt.state),
        }
    return out


def _train_steps(model, opt, ref, plain, steps, start, rank, world_size, scheds=(),
                 out: int = 3) -> None:
    """Sharded on this rank's slice (grads averaged) and plain on the full batch."""
    for step in range(start, start + steps):
        x, y = _batch(step, out=out)
        opt.zero_grad()
        _backward_averaged(model, x, y, rank, world_size)
        opt.step()
        plain.zero_grad()
        _loss(ref, x, y).backward()
        plain.step()
        for s in scheds:
            s.step()


def _state_dicts_close(ours: dict, theirs: dict, exact: bool = False) -> bool:
    if ours["param_groups"] != theirs["param_groups"]:
        return False
    if ours["state"].keys() != theirs["state"].keys():
        return False
    for index, entry in theirs["state"].items():
        if entry.keys() != ours["state"][index].keys():
            return False
        for key, value in entry.items():
            mine = ours["state"][index][key]
            if exact and not torch.equal(mine, value):
                return False
            if not exact and not torch.allclose(mine, value, rtol=1e-10, atol=1e-14):
                return False
    return True


def _error_of(fn) -> str | None:
    try:
        fn()
    except RuntimeError as err:
        return str(err)
    return None


def _save_atomically(obj, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def checkpoint_save_rank(rank: int, world_size: int, path: str) -> dict:
    """Train, consolidate onto the last rank, save; reload here, and via a plain optimizer."""
    out: dict = {}
    to = world_size - 1
    kwargs = {"lr": 1e-2, "weight_decay": 0.05}
    model, ref = _model(3), _model(3)
    opt = Broadcasting(_two_groups(model), torch.optim.AdamW, **kwargs)
    plain = torch.optim.AdamW(_two_groups(ref), **kwargs)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.9**s) for o in (opt, plain)]
    _train_steps(model, opt, ref, plain, 5, 0, rank, world_size, scheds)
    out["unconsolidated_error"] = _error_of(opt.state_dict)
    # Looking up any parameter's state (a defaultdict) must not leak into the checkpoint.
    assert sum(len(opt.state[p]) > 0 for p in model.parameters()) == len(
        [p for p in model.parameters() if opt.owner_of(p) == rank])
    opt.consolidate_state_dict(to=to)
    out["other_rank_error"] = _error_of(opt.state_dict)
    if rank == to:
        full = opt.state_dict()
        out["matches_plain_state_dict"] = _state_dicts_close(full, plain.state_dict())
        _save_atomically({"model": model.state_dict(), "optim": full,
                          "ref_model": ref.state_dict(), "ref_optim": plain.state_dict()}, path)
    dist.barrier()
    ckpt = torch.load(path, weights_only=False)

    # Same world size: a fresh optimizer loads it and carries on like the plain one.
    model2, opt2, ref2, round_trip = _resume_and_train(ckpt, kwargs, rank, world_size)
    if rank == 0:
        out["round_trip_exact"] = round_trip
    out["stale_error"] = _error_of(opt2.state_dict)
    out["same_ws_err"] = _max_rel_err(model2, ref2)
    out["params"] = _flat(model2)

    # Sharding off: a plain AdamW takes our state dict; and on again from the plain one's.
    model3 = _model(0)
    model3.load_state_dict(ckpt["model"])
    plain3 = torch.optim.AdamW(_two_groups(model3), **kwargs)
    plain3.load_state_dict(copy.deepcopy(ckpt["optim"]))
    ref3 = _model(0)
    ref3.load_state_dict(ckpt["ref_model"])
    plain_ref3 = torch.optim.AdamW(_two_groups(ref3), **kwargs)
    plain_ref3.load_state_dict(copy.deepcopy(ckpt["ref_optim"]))
    for step in range(5, 8):
        x, y = _batch(step)
        for m, o in ((model3, plain3), (ref3, plain_ref3)):
            o.zero_grad()
            _loss(m, x, y).backward()
            o.step()
    out["plain_err"] = _max_rel_err(model3, ref3)
    model4 = copy.deepcopy(model3)
    opt4 = Broadcasting(_two_groups(model4), torch.optim.AdamW, **kwargs)
    opt4.load_state_dict(copy.deepcopy(plain3.state_dict()))
    _train_steps(model4, opt4, model3, plain3, 3, 8, rank, world_size)
    out["back_err"] = _max_rel_err(model4, model3)
    return out


def _resume_and_train(ckpt: dict, kwargs: dict, rank: int, world_size: int) -> tuple:
    """Load ``ckpt`` into a fresh ShardedOptimizer and, beside it, a plain AdamW; train both
    5 more steps.

    Returns:
        (model, sharded optimizer, reference model, whether the consolidated state equals
        the checkpoint's exactly: on rank 0, else None).
    """
    model, ref = _model(0), _model(0)
    model.load_state_dict(ckpt["model"])
    ref.load_state_dict(ckpt["ref_model"])
    opt = Broadcasting(_two_groups(model), torch.optim.AdamW, **kwargs)
    opt.load_state_dict(copy.deepcopy(ckpt["optim"]))
    plain = torch.optim.AdamW(_two_groups(ref), **kwargs)
    plain.load_state_dict(copy.deepcopy(ckpt["ref_optim"]))
    opt.consolidate_state_dict(to=0)
    round_trip = None
    if rank == 0:
        round_trip = _state_dicts_close(opt.state_dict(), ckpt["optim"], exact=True)
    _train_steps(model, opt, ref, plain, 5, 5, rank, world_size)
    return model, opt, ref, round_trip


def checkpoint_load_rank(rank: int, world_size: int, path: str) -> dict:
    """Load a checkpoint saved at another world size; it must carry on like the plain one."""
    kwargs = {"lr": 1e-2, "weight_decay": 0.05}
    ckpt = torch.load(path, weights_only=False)
    model, _opt, ref, round_trip = _resume_and_train(ckpt, kwargs, rank, world_size)
    out: dict = {}
    if rank == 0:
        out["round_trip_exact"] = round_trip
    out["err"] = _max_rel_err(model, ref)
    out["params"] = _flat(model)
    return out


# ---------------------------------------------------------------------------- tests
def training_rank(rank: int, world_size: int, checkpoint_path: str) -> dict:
    """Every training scenario in one process group: each run_ranks call costs seconds."""
    return {
        "parity": parity_rank(rank, world_size),
        "tiny": tiny_rank(rank, world_size),
        "add_group": add_group_rank(rank, world_size),
        "checkpoint": checkpoint_save_rank(rank, world_size, checkpoint_path),
    }


_CHECKPOINT_DIR = tempfile.mkdtemp(prefix="zero1-test-ckpt-")
atexit.register(shutil.rmtree, _CHECKPOINT_DIR, ignore_errors=True)


def _checkpoint_path(world_size: int) -> str:
    return os.path.join(_CHECKPOINT_DIR, f"ws{world_size}.pt")


@functools.cache
def _training_results(world_size: int) -> tuple[list[dict] | None, str | None]:
    """One run of ``training_rank`` per world size, shared by the tests below."""
    try:
        return run_ranks(training_rank, world_size, _checkpoint_path(world_size),
                         timeout=240), None
    except RankFailed as err:  # cached too: a failure is reported by each test, once run
        return None, str(err)


def _results(world_size: int, part: str) -> list[dict]:
    results, error = _training_results(world_size)
    if results is None:
        pytest.fail(f"the shared training run failed:\n{error}")
    return [res[part] for res in results]


def _same_on_every_rank(results: list[dict], key: str) -> None:
    for name in results[0]:
        if not isinstance(results[0][name], dict):
            continue
        for r, res in enumerate(results):
            assert torch.equal(res[name][key], results[0][name][key]), (name, r)


def _check_accounting(results: list[dict], name: str, world_size: int) -> None:
    per_rank = [res[name] for res in results]
    assert sum(r["state_numel"] for r in per_rank) == per_rank[0]["plain_state_numel"]
    total = sum(r["owned_numel"] for r in per_rank)
    assert total == sum(per_rank[0]["sizes"])
    largest = max(per_rank[0]["sizes"])
    for r in per_rank:
        assert r["owned_numel"] <= total / world_size + largest


def test_parity_accounting_and_coalesced_exchange(world_size: int) -> None:
    results = _results(world_size, "parity")
    _same_on_every_rank(results, "params")
    for name, *_ in SCENARIOS:
        for r, res in enumerate(results):
            assert res[name]["err"] < TOL, (name, r, res[name]["err"])
        _check_accounting(results, name, world_size)
        # One float64 buffer: at most one broadcast per rank, never one per tensor.
        expected = 0 if world_size == 1 else min(world_size, len(results[0][name]["sizes"]))
        for res in results:
            assert res[name]["expected_broadcasts"] == expected
            assert all(n == expected for n in res[name]["broadcasts"])


def test_more_ranks_than_parameters(world_size: int) -> None:
    results = _results(world_size, "tiny")
    for res in results:
        if world_size > 1:
            assert "ranks [" in res["mismatch_error"] and "differ" in res["mismatch_error"]
        for name in ("AdamW", "SGD"):
            assert res[name]["err"] < TOL, (name, res[name]["err"])
    _same_on_every_rank(results, "params")
    for name in ("AdamW", "SGD"):
        owns = [res[name]["owns"] for res in results]
        assert owns == ([2] if world_size == 1 else [1, 1] + [0] * (world_size - 2))


def test_add_param_group_mid_training_with_scheduler(world_size: int) -> None:
    results = _results(world_size, "add_group")
    for res in results:
        for name in ("AdamW", "SGD"):
            assert res[name]["err"] < TOL, (name, res[name]["err"])
    _same_on_every_rank(results, "params")


def test_checkpoint_round_trips_same_world_size_and_plain(world_size: int) -> None:
    results = _results(world_size, "checkpoint")
    to = world_size - 1
    for rank, res in enumerate(results):
        assert res["unconsolidated_error"] and "consolidate_state_dict" in res[
            "unconsolidated_error"]
        assert (res["other_rank_error"] is None) == (rank == to)
        assert res["stale_error"] and "consolidate_state_dict" in res["stale_error"]
        for key in ("same_ws_err", "plain_err", "back_err"):
            assert res[key] < TOL, (rank, key, res[key])
    assert results[to]["matches_plain_state_dict"]
    assert results[0]["round_trip_exact"]
    _same_on_every_rank([{"x": r} for r in results], "params")


def _other_world_size(world_size: int) -> int:
    return world_size - 1 if world_size > 2 else world_size + 1


def test_checkpoint_loads_into_another_world_size(world_size: int) -> None:
    _results(world_size, "checkpoint")  # the run that saved it
    other = _other_world_size(world_size)
    results = run_ranks(checkpoint_load_rank, other, _checkpoint_path(world_size), timeout=120)
    assert results[0]["round_trip_exact"]
    for res in results:
        assert res["err"] < TOL, res["err"]
    _same_on_every_rank([{"x": r} for r in results], "params")


shape_st = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


cases_st = st.lists(st.lists(shape_st, min_size=1, max_size=8), min_size=1, max_size=4).flatmap(
    lambda shape_lists: st.tuples(
        st.just(shape_lists),
        st.tuples(*(st.integers(0, len(shapes)) for shapes in shape_lists)),
    )
)


# Each example is one run_ranks call (seconds), so few examples of several cases each.
@settings(max_examples=2)
@given(cases=cases_st)
def test_property_drawn_shapes(world_size: int, cases) -> None:
    shape_lists, splits = cases
    results = run_ranks(property_rank, world_size, shape_lists, list(splits), timeout=120)
    for case, shapes in enumerate(shape_lists):
        sizes = [torch.Size(s).numel() for s in shapes]
        per_case = [res[case] for res in results]
        _same_on_every_rank(per_case, "params")
        for name in ("AdamW", "SGD"):
            per_rank = [res[name] for res in per_case]
            assert all(r["equal"] for r in per_rank), (case, name)
            assert sum(r["state_numel"] for r in per_rank) == per_rank[0]["plain_state_numel"]
            for r in per_rank:
                assert r["owned_numel"] <= sum(sizes) / world_size + max(sizes)
