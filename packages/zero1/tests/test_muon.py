"""``zero1.Muon`` in one process: the Newton-Schulz iteration against a float64 reference
through the SVD, the step against the update written out, agreement with
``torch.optim.Muon`` (where this torch has it) including state dicts both ways, bad input,
and the sharded optimizers at one rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import zero1
from zero1 import Muon, ShardedOptimizer
from zero1.muon import NS_COEFFICIENTS, adjusted_lr, newton_schulz

pytestmark = pytest.mark.skipif(
    dist.is_available() and dist.is_initialized(),
    reason="needs a process without an initialised default process group",
)
TORCH_MUON = getattr(torch.optim, "Muon", None)
needs_torch_muon = pytest.mark.skipif(TORCH_MUON is None,
                                      reason="this torch has no torch.optim.Muon (2.9+)")
#: Norm-relative error of the iteration against the float64 reference, per dtype.
NS_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 6e-2}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-300)).item()


def _ns_reference(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """The iteration on the singular values, in float64: ``X = USVᵀ`` gives
    ``aX + (bXXᵀ + c(XXᵀ)²)X = U(aS + bS³ + cS⁵)Vᵀ``."""
    a, b, c = NS_COEFFICIENTS
    g = g.double()
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    s = s / g.norm().clamp(min=eps)
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return u @ torch.diag(s) @ vh


@given(rows=st.integers(1, 24), cols=st.integers(1, 24), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from(list(NS_TOL)), steps=st.integers(0, 6))
def test_newton_schulz_matches_the_singular_value_reference(rows, cols, seed, dtype, steps):
    g = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed),
                    dtype=torch.float64)
    got = newton_schulz(g, steps=steps, dtype=dtype)
    assert got.dtype == dtype and got.shape == g.shape
    assert _rel(got, _ns_reference(g, steps)) < NS_TOL[dtype]
    # Scale does not matter (it is normalised away), nor the orientation.
    assert _rel(newton_schulz(g * 7.5, steps=steps, dtype=dtype), got) < NS_TOL[dtype]
    assert _rel(newton_schulz(g.T, steps=steps, dtype=dtype), got.T) < NS_TOL[dtype]


def test_newton_schulz_orthogonalises_and_keeps_zero():
    g = torch.randn(32, 16, dtype=torch.float64)
    s = torch.linalg.svdvals(newton_schulz(g, dtype=torch.float32).double())
    assert s.min().item() > 0.6 and s.max().item() < 1.25  # near 1, not 1: by design
    assert torch.equal(newton_schulz(torch.zeros(3, 4)), torch.zeros(3, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="2-D"):
        newton_schulz(torch.zeros(3))


@given(n=st.integers(1, 4), rows=st.integers(1, 9), cols=st.integers(1, 9),
       seed=st.integers(0, 2**31 - 1))
def test_a_stack_is_each_matrix_on_its_own(n, rows, cols, seed):
    """Batched iteration: the same result as one matrix at a time (each by its own norm)."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-3, 3, n, dtype=torch.float64)[:, None, None]
    stack = torch.randn(n, rows, cols, generator=gen, dtype=torch.float64) * scales
    together = newton_schulz(stack, dtype=None)
    for i in range(n):
        assert _rel(together[i], newton_schulz(stack[i], dtype=None)) < 1e-12


def test_a_step_over_many_shapes_matches_each_matrix_alone():
    """Matrices grouped into stacks by shape step exactly as each alone in its own Muon."""
    gen = torch.Generator().manual_seed(7)
    shapes = [(6, 4), (4, 6), (6, 4), (5, 5), (6, 4), (4, 6)]
    together = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64))
                for s in shapes]
    alone = [torch.nn.Parameter(p.detach().clone()) for p in together]
    opt = Muon(together, lr=0.02, ns_dtype=None)
    opts = [Muon([p], lr=0.02, ns_dtype=None) for p in alone]
    for _ in range(3):
        grads = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
        for p, q, g in zip(together, alone, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        for o in opts:
            o.step()
    for p, q in zip(together, alone):
        assert _rel(p.detach(), q.detach()) < 1e-13


def _ops_per_step(n_matrices: int) -> int:
    """The operators one Muon step dispatches (each a kernel launch on a GPU) over
    ``n_matrices`` matrices of each of two shapes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    params = [torch.nn.Parameter(torch.randn(shape))
              for shape in [(8, 4), (4, 8)] * n_matrices]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = Muon(params, lr=0.02)
    opt.step()  # the momentum buffers are made here, once
    with Count():
        opt.step()
    return Count.calls


def test_a_steps_launches_do_not_grow_with_the_matrices_of_one_shape():
    """Stacks and multi-tensor kernels: a model of dozens of small matrices pays per shape,
    not per matrix, in launches (the host time of a step on a GPU)."""
    assert _ops_per_step(24) == _ops_per_step(2)


def _step_reference(w, grads, lr, wd, mu, nesterov, fn):
    """The update written out, in float64, with the reference iteration."""
    buf = torch.zeros_like(w)
    for g in grads:
        buf = mu * buf + (1 - mu) * g
        u = (1 - mu) * g + mu * buf if nesterov else buf
        w = w * (1 - lr * wd) - adjusted_lr(lr, w.shape, fn) * _ns_reference(u)
    return w, buf


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("fn", [None, "original", "match_rms_adamw", "spectral_unclamped"])
@pytest.mark.parametrize("shape", [(7, 5), (5, 7), (6, 6), (1, 9)])
def test_step_matches_the_update_written_out(shape, fn, nesterov):
    gen = torch.Generator().manual_seed(hash((shape, fn, nesterov)) % 2**31)
    w0 = torch.randn(shape, generator=gen, dtype=torch.float64)
    grads = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(4)]
    p = torch.nn.Parameter(w0.clone())
    opt = Muon([p], lr=0.03, weight_decay=0.2, momentum=0.9, nesterov=nesterov,
               adjust_lr_fn=fn, ns_dtype=None)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    want, buf = _step_reference(w0, grads, 0.03, 0.2, 0.9, nesterov, fn)
    assert _rel(p.detach(), want) < 1e-12
    assert _rel(opt.state[p]["momentum_buffer"], buf) < 1e-14


def test_adjusted_lr():
    assert adjusted_lr(0.1, (8, 2)) == pytest.approx(0.2)  # sqrt(max(1, 8/2))
    assert adjusted_lr(0.1, (2, 8)) == pytest.approx(0.1)
    assert adjusted_lr(0.1, (2, 8), "spectral_unclamped") == pytest.approx(0.05)
    assert adjusted_lr(0.1, (2, 8), "match_rms_adamw") == pytest.approx(0.1 * 0.2 * 8**0.5)


@needs_torch_muon
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("fn", [None, "match_rms_adamw", "spectral_unclamped"])
def test_agrees_with_torch_optim_muon(fn, nesterov):
    """Same defaults, same bfloat16 iteration, same update: equal to float32 rounding (in
    practice bit for bit), and the same state dict format both ways."""
    gen = torch.Generator().manual_seed(3)
    ours, theirs = [], []
    for shape in [(7, 5), (5, 7), (6, 6), (1, 9), (16, 3)]:
        w = torch.randn(shape, generator=gen)
        ours.append(torch.nn.Parameter(w.clone()))
        theirs.append(torch.nn.Parameter(w.clone()))
    a = Muon(ours, lr=0.02, adjust_lr_fn=fn, nesterov=nesterov)
    b = TORCH_MUON(theirs, lr=0.02, adjust_lr_fn=fn, nesterov=nesterov)
    assert {k: v for k, v in a.defaults.items() if k != "ns_dtype"} == b.defaults

    def train(steps):
        for _ in range(steps):
            for p, q in zip(ours, theirs):
                g = torch.randn(p.shape, generator=gen)
                p.grad, q.grad = g.clone(), g.clone()
            a.step()
            b.step()

    train(3)
    for p, q in zip(ours, theirs):
        assert _rel(p.detach(), q.detach()) < 1e-6
    # Each loads the other's state dict, and training goes on alike.
    theirs_sd, ours_sd = b.state_dict(), a.state_dict()
    a.load_state_dict(theirs_sd)
    assert a.param_groups[0]["ns_dtype"] == torch.bfloat16  # PyTorch's lacks it: its own
    b.load_state_dict(ours_sd)
    train(2)
    for p, q in zip(ours, theirs):
        assert _rel(p.detach(), q.detach()) < 1e-6
        assert _rel(a.state[p]["momentum_buffer"], b.state[q]["momentum_buffer"]) < 1e-6


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"lr": -1.0}, ValueError, "lr"),
        ({"weight_decay": -0.1}, ValueError, "weight_decay"),
        ({"momentum": 1.0}, ValueError, "momentum"),
        ({"ns_steps": 100}, ValueError, "ns_steps"),
        ({"ns_coefficients": (1.0, 2.0)}, ValueError, "ns_coefficients"),
        ({"adjust_lr_fn": "bogus"}, ValueError, "adjust_lr_fn"),
        ({"ns_dtype": torch.int32}, TypeError, "ns_dtype"),
    ],
)
def test_bad_hyperparameters(kwargs, error, match):
    with pytest.raises(error, match=match):
        Muon([torch.nn.Parameter(torch.zeros(2, 2))], **kwargs)


def test_only_2d_parameters():
    with pytest.raises(ValueError, match=r"parameter 1 of param group 0 has shape \[3\].*AdamW"):
        Muon([torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(3))])
    opt = Muon([torch.nn.Parameter(torch.zeros(2, 2))])
    with pytest.raises(ValueError, match=r"param group 1 has shape \[2, 2, 2\]"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, 2, 2))]})
    assert len(opt.param_groups) == 1
    with pytest.raises(TypeError, match="ordered collections"):  # torch.optim's own check
        Muon([{"params": {torch.nn.Parameter(torch.zeros(2, 2))}}])
    # The sharded optimizers refuse them too, before anything else (on every rank).
    with pytest.raises(ValueError, match="has shape \\[3\\]"):
        ShardedOptimizer([torch.nn.Parameter(torch.zeros(3))], Muon, stage=2)
    model = zero1.shard_model(torch.nn.Sequential(torch.nn.Linear(2, 3)))
    with pytest.raises(ValueError, match="has shape \\[3\\]"):
        zero1.Stage3Optimizer(model.parameters(), Muon)


# ---------------------------------------------------------------------------- one rank
def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(7, 3, bias=False)).double()


def _train(model, opts, steps=3, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 5, generator=gen, dtype=torch.float64)
        model(x).square().mean().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_rank_matches_plain_muon_and_saves_its_format(stage):
    kwargs = dict(lr=0.05, weight_decay=0.1, ns_dtype=None)
    plain_model = _net()
    plain = Muon(plain_model.parameters(), **kwargs)
    _train(plain_model, [plain])
    model = _net()
    if stage == 3:
        zero1.shard_model(model)
        opt = zero1.Stage3Optimizer(model.parameters(), Muon, **kwargs)
    else:
        opt = ShardedOptimizer(model.parameters(), Muon, stage=stage, **kwargs)
    _train(model, [opt])
    weights = (zero1.sharding_of(model).full_state_dict() if stage == 3
               else model.state_dict())
    for key, want in plain_model.state_dict().items():
        assert _rel(weights[key], want) < 1e-14
    opt.consolidate_state_dict(to=0)
    saved = opt.state_dict()
    want = plain.state_dict()
    assert saved["param_groups"] == want["param_groups"]
    for k, entry in want["state"].items():
        assert torch.equal(saved["state"][k]["momentum_buffer"], entry["momentum_buffer"])
    if TORCH_MUON is not None:  # PyTorch's Muon loads it as it is, and ours PyTorch's
        TORCH_MUON(_net().parameters()).load_state_dict(saved)
        theirs_model = _net()
        theirs = TORCH_MUON(theirs_model.parameters())
        _train(theirs_model, [theirs], steps=1)
        opt.load_state_dict(theirs.state_dict())
        assert opt.param_groups[0]["ns_dtype"] == torch.bfloat16


def test_load_refuses_another_optimizers_state():
    model = _net()
    opt = ShardedOptimizer(model.parameters(), Muon, stage=1, lr=0.05)
    adamw_model = _net()
    adamw = torch.optim.AdamW(adamw_model.parameters())
    _train(adamw_model, [adamw], steps=1)
    with pytest.raises(ValueError, match="lacks 'momentum'.*another optimizer"):
        opt.load_state_dict(adamw.state_dict())
    plain_model = _net()
    plain = Muon(plain_model.parameters())
    _train(plain_model, [plain], steps=1)
    wrong = plain.state_dict()
    wrong["state"][0]["momentum_buffer"] = torch.zeros(7, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"'momentum_buffer' of parameter 0 in param group 0"):
        opt.load_state_dict(wrong)
    assert not opt.local_optimizer.state  # unchanged


def test_sparse_adam_is_refused_by_the_buckets():
    if not hasattr(torch.optim, "SparseAdam"):
        pytest.skip("no SparseAdam")
    with pytest.raises(TypeError, match="sparse gradients"):
        ShardedOptimizer([torch.nn.Parameter(torch.zeros(2, 2))], torch.optim.SparseAdam)
