"""torch.compile over models that use tritonnorm: whole graphs, and CUDA-graph capture.

On CUDA the norms reach Inductor as Triton operators (``torch.library.triton_op``), which
it launches from its own code; ``mode="reduce-overhead"`` then captures the training step
in CUDA graphs. On the CPU the norms are plain PyTorch and the checks are of tracing only.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tritonnorm
from lab2_testing.tn_numerics import rel_err

CUDA = torch.cuda.is_available()


class TinyBlocks(nn.Module):
    """Linear -> norm -> Linear, then a residual add fused with a second norm."""

    def __init__(self, h: int = 64) -> None:
        super().__init__()
        self.inp = nn.Linear(h, h)
        self.norm1 = tritonnorm.RMSNorm(h)
        self.mid = nn.Linear(h, h)
        self.norm2 = tritonnorm.FusedAddRMSNorm(h)
        self.out = nn.Linear(h, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        y, s = self.norm2(x, self.mid(self.norm1(x)))
        return self.out(y) + s.mean(-1, keepdim=True)


def _train(model: nn.Module, step_model, xs, steps: int = 4) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = step_model(xs[i]).float().square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    return losses


def _pair(device: str, seed: int = 0):
    torch.manual_seed(seed)
    eager = TinyBlocks().to(device)
    twin = TinyBlocks().to(device)
    twin.load_state_dict(eager.state_dict())
    xs = [torch.randn(4, 16, 64, device=device) for _ in range(4)]
    return eager, twin, xs


def test_fullgraph_traces_on_cpu():
    eager, twin, xs = _pair("cpu")
    compiled = torch.compile(twin, fullgraph=True, backend="eager")
    a = _train(eager, eager, xs)
    b = _train(twin, compiled, xs)
    assert all(rel_err(u, v) < 1e-5 for u, v in zip(a, b)), (a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_cpu_gradients_under_dynamo(dtype):
    # RMSNormTorchFunction traced by dynamo: the gradients of x and weight are eager's.
    # (With y aliasing an intermediate, torch 2.11 sent them to a discarded slot: zeros.)
    torch.manual_seed(0)
    x, w = torch.randn(4, 16, dtype=dtype), torch.rand(16) + 0.5

    def grads(fn):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        fn(xg, wg).float().square().sum().backward()
        return xg.grad, wg.grad

    compiled = torch.compile(tritonnorm.rms_norm, fullgraph=True, backend="eager")
    for got, want in zip(grads(compiled), grads(tritonnorm.rms_norm)):
        assert rel_err(got, want) < 1e-6


@pytest.mark.skipif(not CUDA, reason="Inductor launches the Triton operators on CUDA only")
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_training_matches_eager(mode):
    # fullgraph=True fails on any graph break; under reduce-overhead Inductor must also
    # capture every graph (it skips graphs with mutated inputs or CPU tensors).
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager, twin, xs = _pair("cuda")
    compiled = torch.compile(twin, fullgraph=True, mode=mode)
    a = _train(eager, eager, xs)
    b = _train(twin, compiled, xs)
    torch.cuda.synchronize()
    assert all(rel_err(u, v) < 1e-4 for u, v in zip(a, b)), (a, b)
    for p, q in zip(eager.parameters(), twin.parameters()):
        assert rel_err(q, p) < 1e-4
    if mode == "reduce-overhead":
        assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


@pytest.mark.skipif(not CUDA, reason="Inductor launches the Triton operators on CUDA only")
def test_inductor_sees_the_kernels():
    # The operators are triton_ops: Inductor's generated code launches our kernels itself
    # (no opaque call back into Python), which CUDA graphs need.
    from torch._inductor.utils import run_and_get_code

    from tritonnorm import _library
    from tritonnorm.ops import OPTIONS

    if not _library.HAS_TRITON_OP:
        pytest.skip("torch.library.triton_op needs PyTorch 2.6")
    x = torch.randn(32, 64, device="cuda")
    w = torch.rand(64, device="cuda") + 0.5
    with OPTIONS.override(compiled_dispatch="kernels"):
        fn = torch.compile(lambda a, b: tritonnorm.rms_norm(a, b) * 2, fullgraph=True)
        out, code = run_and_get_code(fn, x, w)
    assert "fwd_rows" in "\n".join(code)
    assert rel_err(out, tritonnorm.rms_norm(x, w) * 2) < 1e-6


@pytest.mark.skipif(not CUDA, reason="Inductor launches the Triton operators on CUDA only")
@pytest.mark.parametrize("choice, kernels, small", [
    ("auto", False, False), ("auto", False, True), ("inductor", False, False),
    ("kernels", True, True)])
def test_compiled_dispatch(choice, kernels, small):
    # "auto": a plain norm is left to Inductor (which fuses it with its neighbours), the
    # fused add runs our kernels unless x is below OPTIONS.torch_below (a host-bound
    # call); either way the result is the eager one.
    from torch._inductor.utils import run_and_get_code

    from tritonnorm.ops import OPTIONS

    torch._dynamo.reset()
    x, r = torch.randn(2, 32, 64, device="cuda"), torch.randn(2, 32, 64, device="cuda")
    w = torch.rand(64, device="cuda") + 0.5
    below = {"torch.float32": x.numel() + 1 if small else 0}
    with OPTIONS.override(compiled_dispatch=choice, torch_below=below):
        plain = torch.compile(lambda a, b: tritonnorm.rms_norm(a, b) * 2, fullgraph=True)
        out, code = run_and_get_code(plain, x, w)
        added = torch.compile(lambda a, b, c: tritonnorm.fused_add_rms_norm(a, b, c)[0],
                              fullgraph=True)
        y, add_code = run_and_get_code(added, x, r, w)
    assert ("fwd_rows" in "\n".join(code)) is kernels
    assert ("fwd_rows" in "\n".join(add_code)) is (choice == "kernels"
                                                   or (choice == "auto" and not small))
    assert rel_err(out, tritonnorm.rms_norm(x, w) * 2) < 1e-5
    assert rel_err(y, tritonnorm.fused_add_rms_norm(x, r, w)[0]) < 1e-5
