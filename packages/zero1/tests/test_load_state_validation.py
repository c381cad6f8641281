"""A failed ``ShardedOptimizer.load_state_dict`` raises a clear error and leaves the
optimizer exactly as it was: it keeps training as if the load had never been tried
(one process, and over Gloo ranks)."""

from __future__ import annotations

import copy

import pytest
import torch

from lab2_testing.dist import run_ranks
from zero1 import ShardedOptimizer
from zero1.checkpoint import check_state_dict


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(),
                               torch.nn.Linear(7, 3)).double()


def _groups(model: torch.nn.Module) -> list[dict]:
    return [{"params": list(model[0].parameters()), "lr": 0.02},
            {"params": list(model[2].parameters()), "lr": 0.01, "weight_decay": 0.1}]


def _train(model, opt, steps: int, seed: int, rank: int = 0, world: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 5, generator=gen, dtype=torch.float64)
        opt.zero_grad()
        model(x[rank::world]).square().mean().backward()
        if world > 1 and not getattr(opt, "reduce_gradients", True):  # by hand, as DDP would
            for p in model.parameters():
                torch.distributed.all_reduce(p.grad)
                p.grad /= world
        opt.step()


def _bad_state_dicts(model: torch.nn.Module) -> dict[str, object]:
    """What a user might hand over by mistake, each with a fragment of its error."""
    sgd = torch.optim.SGD(_groups(model), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    sgd.step()
    sgd_sd = copy.deepcopy(sgd.state_dict())
    plain = _model()
    adamw = torch.optim.AdamW(_groups(plain), lr=0.01)
    _train(plain, adamw, 1, seed=3)
    good = adamw.state_dict()
    transposed = copy.deepcopy(good)
    transposed["state"][0]["exp_avg"] = transposed["state"][0]["exp_avg"].t().contiguous()
    no_step = copy.deepcopy(good)
    del no_step["state"][1]["step"]
    as_list = copy.deepcopy(good)
    as_list["state"][0]["exp_avg"] = as_list["state"][0]["exp_avg"].tolist()
    as_ints = copy.deepcopy(good)
    as_ints["state"][0]["exp_avg"] = as_ints["state"][0]["exp_avg"].long()
    stray = copy.deepcopy(good)
    stray["state"][99] = stray["state"][0]
    return {
        "SGD state": (sgd_sd, ValueError, "lacks 'betas', 'eps', which AdamW needs"),
        "a list": ([good], TypeError, "expected an optimizer state dict"),
        "None": (None, TypeError, "got NoneType"),
        "groups not a list": ({"state": {}, "param_groups": 3}, TypeError, "must be a list"),
        "transposed exp_avg": (transposed, ValueError, "'exp_avg' of parameter 0 in param group "
                               "0 has shape [5, 7], the parameter [7, 5]"),
        "state without step": (no_step, ValueError, "the optimizer is unchanged"),
        "exp_avg as a list": (as_list, TypeError, "'exp_avg' of parameter 0 in param group 0 "
                              "is a list"),
        "exp_avg of integers": (as_ints, TypeError, "is a torch.int64 tensor"),
        "stray state": (stray, ValueError, "parameter id 99, which no param group lists"),
    }


def _failed_loads_change_nothing(rank: int, world: int, **kwargs) -> dict:
    model, twin = _model(), _model()
    opt = ShardedOptimizer(_groups(model), torch.optim.AdamW, lr=0.05, **kwargs)
    ref = ShardedOptimizer(_groups(twin), torch.optim.AdamW, lr=0.05, **kwargs)
    _train(model, opt, 2, seed=1, rank=rank, world=world)
    _train(twin, ref, 2, seed=1, rank=rank, world=world)
    errors = {}
    for name, (bad, error, fragment) in _bad_state_dicts(_model(7)).items():
        try:
            opt.load_state_dict(bad)
        except error as exc:
            assert fragment in str(exc), (name, str(exc))
            errors[name] = str(exc)
        else:
            raise AssertionError(f"{name} was loaded")
    # Still usable, and exactly as if nothing had been tried: train on, then compare.
    _train(model, opt, 2, seed=2, rank=rank, world=world)
    _train(twin, ref, 2, seed=2, rank=rank, world=world)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    opt.consolidate_state_dict(to=0)
    ref.consolidate_state_dict(to=0)
    if rank == 0:
        a, b = opt.state_dict(), ref.state_dict()
        same = same and all(torch.equal(a["state"][i][k], b["state"][i][k])
                            for i in b["state"] for k in b["state"][i])
    return {"errors": errors, "same": same}


def test_failed_loads_leave_the_optimizer_as_it_was_one_process():
    got = _failed_loads_change_nothing(0, 1)
    assert got["same"] and len(got["errors"]) == 9


def _rank(rank: int, world_size: int, kwargs: dict) -> dict:
    torch.set_num_threads(1)
    return _failed_loads_change_nothing(rank, world_size, **kwargs)


@pytest.mark.parametrize("kwargs", [{"stage": 1}, {"stage": 2}, {"reduce_gradients": False}],
                         ids=["stage1", "stage2", "broadcast"])
def test_failed_loads_leave_the_optimizer_as_it_was_on_every_rank(world_size, kwargs):
    for got in run_ranks(_rank, world_size, kwargs, timeout=120, pg_timeout=60):
        assert got["same"] and len(got["errors"]) == 9


def test_checks_run_on_meta_tensors_without_an_optimizer_instance():
    """What a launcher does: check a checkpoint's state against shapes only."""
    with torch.device("meta"):
        model = _model()
    meta = torch.optim.AdamW(_groups(model), lr=0.01)
    plain = _model()
    opt = torch.optim.AdamW(_groups(plain), lr=0.01)
    _train(plain, opt, 1, seed=0)
    check_state_dict(opt.state_dict(), meta.param_groups, meta.defaults)
    wrong = opt.state_dict()
    wrong["state"][2]["exp_avg_sq"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"'exp_avg_sq' of parameter 0 in param group 1"):
        check_state_dict(wrong, meta.param_groups, meta.defaults)
