"""ShardedOptimizer without a process group (one rank): input errors, parity, checkpoints.

Without an initialised torch.distributed the optimizer runs as a single rank, which
makes every local check testable here in milliseconds, outside the Gloo matrix.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from zero1 import ShardedOptimizer, optimizer_state_bytes, optimizer_state_numel

pytestmark = pytest.mark.skipif(
    dist.is_available() and dist.is_initialized(),
    reason="needs a process without an initialised default process group",
)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)
    ).double()


def _groups(model: torch.nn.Module) -> list[dict]:
    return [
        {"params": list(model[0].parameters()), "lr": 0.02, "weight_decay": 0.0},
        {"params": list(model[2].parameters()), "lr": 0.01, "weight_decay": 0.1},
    ]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _train(model, opt, steps: int, seed: int, sched=None) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 5, generator=gen, dtype=torch.float64)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if sched is not None:
            sched.step()


# ---------------------------------------------------------------------------- errors
def _p(*shape: int, device: str = "cpu") -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(*shape, device=device))


@pytest.mark.parametrize(
    ("params", "error", "match"),
    [
        ([], ValueError, "empty parameter list"),
        ([{"params": []}], ValueError, "empty parameter list"),
        (_p(3), TypeError, "single .*wrap it in a list"),
        ([_p(3), "weight"], TypeError, "element 1 is a str"),
        ([_p(3), 4.0], TypeError, "element 1 is a float"),
        ([("w", _p(3))], TypeError, "named parameters"),
        (5, TypeError, "iterable"),
        ({_p(3)}, TypeError, "set"),
        ([{"params": {_p(3)}}], TypeError, "set"),
        ([{"lr": 0.1}], ValueError, "no 'params'"),
        ([{"params": [_p(2)]}, _p(3)], TypeError, "mixes"),
        ([_p(3), _p(2, device="meta")], ValueError, "mixed devices"),
    ],
    ids=[
        "empty", "empty-groups", "bare-tensor", "str", "float", "named", "int", "set",
        "set-in-group", "no-params-key", "mixed-items", "mixed-devices",
    ],
)
def test_bad_params_raise_clear_errors(params, error, match) -> None:
    with pytest.raises(error, match=match):
        ShardedOptimizer(params, torch.optim.AdamW, lr=1e-3)


def test_duplicate_parameters_are_rejected() -> None:
    p, q = _p(3), _p(4)
    with pytest.raises(ValueError, match="more than once"):
        ShardedOptimizer([p, q, p], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="more than once"):
        ShardedOptimizer([{"params": [p]}, {"params": [q, p]}], torch.optim.SGD, lr=0.1)
    opt = ShardedOptimizer([p], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="more than once"):
        opt.add_param_group({"params": [q, p]})
    with pytest.raises(ValueError, match="mixed devices"):
        opt.add_param_group({"params": [_p(2, device="meta")]})
    with pytest.raises(TypeError, match="must be a dict"):
        opt.add_param_group([q])  # type: ignore[arg-type]
    assert len(opt.param_groups) == 1 and len(opt.local_optimizer.param_groups) == 1


@pytest.mark.parametrize(
    ("cls", "match"),
    [
        (torch.optim.Optimizer, "defaults"),  # the abstract base: a subclass of itself
        (torch.nn.Linear, "optimizer_cls"),
        ("AdamW", "optimizer_cls"),
        (ShardedOptimizer, "optimizer_cls"),
        (torch.optim.LBFGS, "LBFGS"),
    ],
)
def test_bad_optimizer_cls(cls, match) -> None:
    with pytest.raises(TypeError, match=match):
        ShardedOptimizer([_p(2)], cls)


def test_optimizer_argument_errors_come_from_the_optimizer() -> None:
    with pytest.raises(ValueError, match="learning rate"):
        ShardedOptimizer([_p(2)], torch.optim.AdamW, lr=-1.0)


def test_missing_init_process_group_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="init_process_group"):
        ShardedOptimizer([_p(2)], torch.optim.AdamW)
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(RuntimeError, match="not initialized"):
        ShardedOptimizer([_p(2)], torch.optim.AdamW, process_group=object())  # type: ignore[arg-type]


def test_state_dict_needs_consolidation_and_goes_stale() -> None:
    model = _model()
    opt = ShardedOptimizer(_groups(model), torch.optim.AdamW)
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        opt.state_dict()
    _train(model, opt, 1, seed=1)
    opt.consolidate_state_dict()
    opt.state_dict()
    _train(model, opt, 1, seed=2)
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        opt.state_dict()
    for bad in (1, -1, "0"):
        with pytest.raises(ValueError, match="to must be a rank"):
            opt.consolidate_state_dict(to=bad)  # type: ignore[arg-type]


def test_load_state_dict_rejects_mismatched_layouts() -> None:
    model = _model()
    opt = ShardedOptimizer(_groups(model), torch.optim.AdamW)
    other = torch.optim.AdamW(model.parameters())  # one group instead of two
    with pytest.raises(ValueError, match="1 param groups"):
        opt.load_state_dict(other.state_dict())
    uneven = torch.optim.AdamW(
        [{"params": [model[0].weight]}, {"params": [model[0].bias, *model[2].parameters()]}]
    )
    with pytest.raises(ValueError, match="param group 0"):
        opt.load_state_dict(uneven.state_dict())
    with pytest.raises(ValueError, match="'state' and 'param_groups'"):
        opt.load_state_dict({"state": {}})


# ---------------------------------------------------------------------------- behaviour
OPTIMIZERS = [
    (torch.optim.AdamW, {"lr": 3e-3, "betas": (0.8, 0.95)}),
    (torch.optim.Adam, {"lr": 3e-3, "amsgrad": True}),
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    (torch.optim.RMSprop, {"lr": 1e-3, "momentum": 0.5}),
    (torch.optim.Adagrad, {"lr": 0.05}),
]


@pytest.mark.parametrize(("cls", "kwargs"), OPTIMIZERS, ids=lambda v: getattr(v, "__name__", ""))
def test_single_rank_matches_plain_optimizer_and_checkpoints(cls, kwargs) -> None:
    model, ref = _model(), _model()
    opt = ShardedOptimizer(_groups(model), cls, **kwargs)
    plain = cls(_groups(ref), **kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(plain, lambda s: 0.9**s)
    _train(model, opt, 6, seed=3, sched=sched)
    _train(ref, plain, 6, seed=3, sched=ref_sched)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert _rel_err(p, q) < 1e-12
    assert optimizer_state_bytes(opt) == optimizer_state_bytes(plain) == opt.local_state_bytes()
    assert optimizer_state_numel(opt) == optimizer_state_numel(plain)

    opt.consolidate_state_dict()
    ours, theirs = opt.state_dict(), plain.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys()
    for index, entry in theirs["state"].items():
        for key, value in entry.items():
            assert torch.equal(ours["state"][index][key], value), (index, key)

    # Switch sharding off and on again: each loads the other's state dict.
    model2, ref2 = copy.deepcopy(model), copy.deepcopy(ref)
    plain2 = cls(_groups(ref2), **kwargs)
    plain2.load_state_dict(copy.deepcopy(ours))
    opt2 = ShardedOptimizer(_groups(model2), cls, **kwargs)
    opt2.load_state_dict(copy.deepcopy(theirs))
    _train(model2, opt2, 4, seed=4)
    _train(ref2, plain2, 4, seed=4)
    for p, q in zip(model2.parameters(), ref2.parameters()):
        assert _rel_err(p, q) < 1e-12


def test_closure_hooks_and_scheduler_reach_the_local_optimizer() -> None:
    model = _model()
    opt = ShardedOptimizer(_groups(model), torch.optim.SGD, lr=0.1, momentum=0.9)
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("sd"))
    x = torch.randn(4, 5, dtype=torch.float64)

    def closure():
        calls.append("closure")
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and calls == ["pre", "closure", "post"]
    opt.param_groups[1]["lr"] = 0.123
    opt.step(closure)
    assert opt.local_optimizer.param_groups[1]["lr"] == 0.123
    opt.consolidate_state_dict()
    assert opt.state_dict()["param_groups"][1]["lr"] == 0.123 and calls[-1] == "sd"
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    opt.step(closure)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    assert "SGD" in repr(opt) and opt.world_size == 1 and opt.rank == 0
    assert opt.owner_of(model[0].weight) == 0 and opt.broadcasts_per_step == 0
    with pytest.raises(ValueError, match="not one of the parameters"):
        opt.owner_of(torch.zeros(1))


def test_add_param_group_mid_training_matches_plain() -> None:
    model, ref = _model(), _model()
    opt = ShardedOptimizer([{"params": list(model[2].parameters())}], torch.optim.AdamW, lr=1e-2)
    plain = torch.optim.AdamW([{"params": list(ref[2].parameters())}], lr=1e-2)
    _train(model, opt, 3, seed=5)
    _train(ref, plain, 3, seed=5)
    opt.add_param_group({"params": list(model[0].parameters()), "lr": 3e-2})
    plain.add_param_group({"params": list(ref[0].parameters()), "lr": 3e-2})
    assert opt.param_groups[1]["lr"] == 3e-2 and opt.param_groups[1]["betas"] == (0.9, 0.999)
    _train(model, opt, 3, seed=6)
    _train(ref, plain, 3, seed=6)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert _rel_err(p, q) < 1e-12


def test_local_optimizer_takes_the_users_implementation_options() -> None:
    # The shard's optimizer gets the user's options as they are, and group edits reach it.
    model, ref = _model(), _model()
    opt = ShardedOptimizer(_groups(model), torch.optim.AdamW, lr=1e-2)
    plain = torch.optim.AdamW(_groups(ref), lr=1e-2)
    assert [g["foreach"] for g in opt.local_optimizer.param_groups] == [None, None]
    _train(model, opt, 3, seed=7)
    _train(ref, plain, 3, seed=7)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert _rel_err(p, q) < 1e-12
    opt.consolidate_state_dict()
    assert opt.state_dict()["param_groups"] == plain.state_dict()["param_groups"]
    opt.param_groups[1]["foreach"] = True
    _train(model, opt, 1, seed=8)
    assert opt.local_optimizer.param_groups[1]["foreach"] is True
    looped = ShardedOptimizer(_groups(_model()), torch.optim.AdamW, lr=1e-2, foreach=False)
    assert [g["foreach"] for g in looped.local_optimizer.param_groups] == [False, False]
    groups = _groups(_model())
    groups[0]["foreach"] = True
    mixed = ShardedOptimizer(groups, torch.optim.SGD, lr=0.1)
    assert [g["foreach"] for g in mixed.local_optimizer.param_groups] == [True, None]
    assert [g["foreach"] for g in mixed.param_groups] == [True, None]
    # Classes without a foreach option get nothing added.
    class Descent(torch.optim.Optimizer):
        def __init__(self, params, lr):
            super().__init__(params, {"lr": lr})

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    p.data.add_(p.grad, alpha=-group["lr"])

    own = ShardedOptimizer(_groups(_model()), Descent, lr=0.1)
    assert "foreach" not in own.local_optimizer.defaults and "foreach" not in own.defaults
