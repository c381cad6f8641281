"""Regional compilation (``--compile``, ``--compile-scope blocks``): one compiled graph
serves every block whatever the depth, the gradients are eager's, activation
checkpointing composes with it, decoding never compiles, and a short inductor run gives
eager's losses."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from lab2_testing.ddp_testkit import relative_error
from lab2_trainer.config import ModelConfig, TrainSettings
from lab2_trainer.models.transformer import TransformerLM
from lab2_trainer.parallel.parallelize import compile_model

torch.set_num_threads(1)


def config(n_layers: int, norm: str = "tritonnorm") -> ModelConfig:
    return ModelConfig(context_length=16, d_model=32, n_layers=n_layers, n_heads=2, d_ff=64,
                       norm=norm)


def graphs_and_grads(n_layers: int, kind: str, scope: str = "blocks") -> tuple[int, dict]:
    """Compile a fresh model (dynamo's ``eager`` backend: the captured graphs run as they
    are), take one forward and backward, and return the graphs compiled and the model's
    loss and gradients."""
    torch._dynamo.reset()
    counters.clear()
    model = TransformerLM(config(n_layers), seed=1, activation_checkpointing=kind)
    forward = compile_model(model, backend="eager", scope=scope)
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randint(0, 256, (2, 2, 16), generator=gen)
    _, loss = forward(x, y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return counters["stats"]["unique_graphs"], {"loss": loss.detach(), **grads}


def eager_grads(n_layers: int) -> dict:
    model = TransformerLM(config(n_layers), seed=1)
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randint(0, 256, (2, 2, 16), generator=gen)
    _, loss = model(x, y)
    loss.backward()
    return {"loss": loss.detach(), **{n: p.grad.clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("kind", ["none", "full", "selective"])
def test_one_graph_serves_every_block_whatever_the_depth(kind):
    graphs, grads = graphs_and_grads(5, kind)
    # The embedding, the head and one for all five blocks (the first is given a pending
    # branch of zeros like the others'): a graph per block would make 7.
    assert graphs == 3, graphs
    want = eager_grads(5)
    assert relative_error(want, grads) < 1e-6


def test_whole_model_scope_is_one_graph_with_eager_gradients():
    # Selective checkpointing inside the whole model's graph too.
    graphs, grads = graphs_and_grads(3, "selective", scope="model")
    assert graphs == 1
    want = eager_grads(3)
    assert relative_error(want, grads) < 1e-6


def test_decoding_a_compiled_model_compiles_nothing():
    torch._dynamo.reset()
    counters.clear()
    eager = TransformerLM(config(2), seed=1)
    model = TransformerLM(config(2), seed=1)
    model.compile_regions(backend="eager")
    prompt = torch.tensor([[1, 2, 3]])
    for use_cache in (True, False):
        got = model.generate(prompt, 20, temperature=0, use_cache=use_cache)
        assert torch.equal(got, eager.generate(prompt, 20, temperature=0, use_cache=use_cache))
    assert counters["frames"]["total"] == 0


def test_a_bad_compile_scope_is_refused():
    with pytest.raises(ValueError, match="--compile-scope must be one of blocks, model"):
        TrainSettings(compile_scope="layers").check()
    with pytest.raises(ValueError, match="compile scope must be"):
        compile_model(TransformerLM(config(1)), backend="eager", scope="layers")


@pytest.mark.slow
def test_inductor_regional_compilation_gives_eager_losses():
    # inductor generates and builds C++ kernels for the CPU: the real compiler, on a
    # two-block model (one graph for both blocks) for three AdamW steps.
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(3)
    batches = torch.randint(0, 256, (3, 2, 4, 16), generator=gen)
    runs = {}
    for compiled in (False, True):
        model = TransformerLM(config(2, norm="torch"), seed=1)
        if compiled:
            model.compile_regions(backend="inductor")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        runs[compiled] = []
        for x, y in batches:
            _, loss = model(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            runs[compiled].append(loss.item())
    for got, want in zip(runs[True], runs[False]):
        assert abs(got - want) <= 1e-5 * abs(want), (runs[True], runs[False])
