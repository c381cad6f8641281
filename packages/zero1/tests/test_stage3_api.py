"""ZeRO stage 3 in one process: the default units, what parameters hold between steps,
bad input refused before any work, and the pieces partitioning every parameter."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import zero1
from zero1.stage3 import default_units


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 6)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3))
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def test_default_units_are_the_module_list_entries():
    net = Net()
    assert default_units(net) == list(net.layers)
    zero1.shard_model(net)
    units = zero1.sharding_of(net).units
    assert [u.name for u in units] == ["layers.0", "layers.1", "layers.2", ""]
    assert units[-1].is_root and len(units[-1].params) == 4  # inp and out


def test_parameters_between_steps_keep_shape_but_no_storage():
    net, ref = Net(), Net()
    zero1.shard_model(net, param_dtype=torch.bfloat16)  # one rank, but gathered in bf16
    sharded = zero1.sharding_of(net)
    opt = zero1.Stage3Optimizer(net.parameters(), torch.optim.SGD, lr=0.1)
    for p, q in zip(net.parameters(), ref.parameters()):
        assert p.shape == q.shape and p.dtype == torch.bfloat16
        assert p.untyped_storage().nbytes() == 0
    x = torch.randn(5, 4)
    net(x).square().mean().backward()
    assert all(p.grad is None for p in net.parameters())  # reduced into the shards
    assert len(opt.shard_gradients()) == 10
    opt.step()
    assert sharded.gathered_bytes() == 0
    with torch.no_grad():
        net(x)  # an evaluation forward frees what it gathered, the root too
    assert sharded.gathered_bytes() == 0


def test_no_sync_keeps_full_gradients_until_the_next_backward():
    net = Net().double()
    zero1.shard_model(net)
    opt = zero1.Stage3Optimizer(net.parameters(), torch.optim.SGD, lr=0.1)
    x = torch.randn(5, 4, dtype=torch.float64)
    with opt.no_sync():
        net(x).sum().backward()
    assert all(p.grad is not None for p in net.parameters())
    net(x).sum().backward()
    assert all(p.grad is None for p in net.parameters())
    plain = Net().double()
    (2 * plain(x).sum()).backward()
    want = torch.cat([p.grad.reshape(-1) for p in plain.parameters()])
    got = torch.cat([g.reshape(-1) for g in opt.shard_gradients()])
    assert torch.allclose(got, want, rtol=1e-12, atol=0)


def test_bad_input_raises_before_any_work():
    with pytest.raises(TypeError, match="nn.Module"):
        zero1.shard_model("model")  # type: ignore[arg-type]
    net = Net()
    with pytest.raises(ValueError, match="not a submodule"):
        zero1.shard_model(net, units=[nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="root unit"):
        zero1.shard_model(net, units=[net])
    with pytest.raises(ValueError, match="listed twice"):
        zero1.shard_model(net, units=[net.inp, net.inp])
    with pytest.raises(TypeError, match="param_dtype"):
        zero1.shard_model(net, param_dtype=torch.int8)
    with pytest.raises(TypeError, match="reshard_after_forward"):
        zero1.shard_model(net, reshard_after_forward="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no parameters"):
        zero1.shard_model(nn.ReLU())
    mixed = Net()
    mixed.out.double()
    with pytest.raises(ValueError, match="mixes parameter dtypes"):
        zero1.shard_model(mixed, units=[])
    with pytest.raises(ValueError, match="shard_model"):
        zero1.Stage3Optimizer(Net().parameters(), torch.optim.AdamW)
    zero1.shard_model(net)
    with pytest.raises(ValueError, match="sharded already"):
        zero1.shard_model(net)
    if hasattr(torch.optim, "SparseAdam"):
        with pytest.raises(TypeError, match="sparse gradients"):
            zero1.Stage3Optimizer(net.parameters(), torch.optim.SparseAdam)
    opt = zero1.Stage3Optimizer(net.parameters(), torch.optim.AdamW)
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        opt.state_dict()


def test_a_bad_full_state_dict_changes_nothing():
    net = Net()
    zero1.shard_model(net)
    sharded = zero1.sharding_of(net)
    before = sharded.full_state_dict()
    bad = copy.deepcopy(before)
    bad["out.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="out.weight has shape"):
        sharded.load_full_state_dict(bad)
    del bad["out.weight"]
    with pytest.raises(ValueError, match="missing keys"):
        sharded.load_full_state_dict(bad)
    after = sharded.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.timeout(300)
def test_a_compiled_model_gathers_outside_its_graphs():
    """torch.compile of the whole sharded model: the hooks run as Python between the
    compiled regions, and training matches the eager model's."""
    losses = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        net = Net().double()
        zero1.shard_model(net)
        opt = zero1.Stage3Optimizer(net.parameters(), torch.optim.AdamW, lr=1e-2)
        forward = torch.compile(net, backend="aot_eager") if compiled else net
        losses[compiled] = []
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(5, 4, dtype=torch.float64, generator=gen)
            loss = forward(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[compiled].append(loss.item())
    assert losses[True] == pytest.approx(losses[False], rel=1e-12)


def _train_and_drop(step: bool) -> list[weakref.ref]:
    """Shard a model, build its optimizer, train one step (or not), and drop both; return
    weak references to the model, its sharding, its parameters and their shards."""
    net = Net()
    zero1.shard_model(net)
    sharded = zero1.sharding_of(net)
    opt = zero1.Stage3Optimizer(net.parameters(), torch.optim.AdamW, lr=1e-2)
    if step:
        net(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    refs = [weakref.ref(net), weakref.ref(sharded), *map(weakref.ref, net.parameters())]
    refs += [weakref.ref(u.shard) for u in sharded.units]
    return refs


@pytest.mark.parametrize("step", [False, True], ids=["built", "trained"])
def test_a_dropped_sharded_model_is_collected(step):
    refs = [r for _ in range(3) for r in _train_and_drop(step)]
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    assert not alive, f"{len(alive)} of {len(refs)} objects outlived their model: " + ", ".join(
        sorted({type(o).__name__ for o in alive}))


@pytest.mark.parametrize("params, error, match", [
    ([], ValueError, "empty parameter list"),
    ([{"params": []}], ValueError, "empty parameter list"),
    (torch.zeros(2), TypeError, "single"),
    ({torch.zeros(2)}, TypeError, "set"),
    ([{"lr": 0.1}], ValueError, "no 'params'"),
    ([1.0], TypeError, "not a torch.Tensor"),
])
def test_stage3_optimizer_refusals_name_it(params, error, match):
    with pytest.raises(error, match=match) as info:
        zero1.Stage3Optimizer(params, torch.optim.SGD, lr=0.1)
    assert str(info.value).startswith("Stage3Optimizer: "), info.value
    assert "ShardedOptimizer" not in str(info.value)


def test_stage3_optimizer_names_itself_for_a_parameter_listed_twice():
    net = Net()
    zero1.shard_model(net)
    p = next(net.parameters())
    with pytest.raises(ValueError, match="more than once") as info:
        zero1.Stage3Optimizer([p, p], torch.optim.SGD, lr=0.1)
    assert str(info.value).startswith("Stage3Optimizer: ")
    opt = zero1.Stage3Optimizer([p], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="more than once") as info:
        opt.add_param_group({"params": [p]})
    assert str(info.value).startswith("Stage3Optimizer: ")
