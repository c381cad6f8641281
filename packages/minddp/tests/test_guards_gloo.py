"""Construction checks, broadcast, gradient views and misuse errors, over Gloo."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from lab2_testing import run_ranks
from minddp import (
    DDPBucketed,
    DDPIndividualParameters,
    ModelMismatchError,
    broadcast_module,
    check_model_consistency,
)


def _testkit():
    # Loaded by path: pytest's importlib mode keeps this folder off sys.path.
    name = "_minddp_ddp_testkit"
    if name not in sys.modules:
        path = Path(__file__).with_name("ddp_testkit.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


kit = _testkit()
SEED = 7

# How the last rank's model differs, and what the error must name.
MUTATIONS = {
    "shape": ("layers.0.weight", "shape="),
    "dtype": ("frozen_scale", "dtype="),  # own parameters come before submodules
    "frozen": ("layers.1.weight", "requires_grad="),
    "extra": ("layers.1.extra", "vs param 'layers.1.extra'"),
}


def _mutated_mlp(mutation: str, rank: int, world_size: int) -> torch.nn.Module:
    last = rank == world_size - 1
    widths = (6, 9, 3) if last and mutation == "shape" else (6, 8, 3)
    model = kit.build_model("mlp", SEED, widths=widths)
    if last and mutation == "dtype":
        model.float()
    if last and mutation == "frozen":
        model.layers[1].requires_grad_(False)
    if last and mutation == "extra":
        model.layers[1].extra = torch.nn.Parameter(torch.zeros(2, dtype=kit.DTYPE))
    return model


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _bucketed_step(ddp: DDPBucketed, x: torch.Tensor, y: torch.Tensor) -> None:
    kit.summed_loss("mlp", ddp(x), y).backward()
    ddp.finish_gradient_synchronization()


def _guards_rank(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    out: dict = {"mismatch": {}, "errors": {}}
    # 1. A model that differs on one rank: every rank raises, none hangs.
    if world_size > 1:
        for mutation in MUTATIONS:
            for wrapper in (DDPBucketed, DDPIndividualParameters, None):
                model = _mutated_mlp(mutation, rank, world_size)
                try:
                    if wrapper is None:
                        check_model_consistency(model)
                    else:
                        wrapper(model)
                    out["mismatch"][(mutation, str(wrapper))] = None
                except ModelMismatchError as error:
                    out["mismatch"][(mutation, str(wrapper))] = str(error)
    # 2. broadcast_module from the last rank: parameters and buffers.
    model = kit.build_model("mlp", SEED + rank)
    broadcast_module(model, src=world_size - 1)
    out["broadcast"] = kit.snapshot(model)
    # 3. Gradients are views into bucket buffers, also after zero_grad(set_to_none=True).
    x, y = kit.make_batches("mlp", SEED, 1, 4)[0]
    model = kit.build_model("mlp", SEED)
    ddp = DDPBucketed(model, kit.few_buckets_mb(model))
    out["bucket_names"] = ddp.bucket_parameter_names
    views_ok = []
    for _ in range(3):
        _bucketed_step(ddp, x, y)
        storages = {_storage(b.buffer) for b in ddp._buckets}
        views_ok.append(
            all(_storage(p.grad) in storages for n, p in model.named_parameters()
                if p.requires_grad and n != "unused")
            and model.unused.grad is None
        )
        model.zero_grad(set_to_none=True)
    out["views_ok"] = views_ok
    out["stats"] = ddp.last_sync_stats
    out["bucket_counts"] = {
        variant: len(kit.wrap(variant, kit.build_model("mlp", SEED))[0]._buckets)
        for variant in ("bucketed_tiny", "bucketed_few", "bucketed_one")
    }
    # 4. Misuse: forward before finishing, and a second backward after launching.
    # (tiny buckets, so that some bucket surely went out during the first backward)
    for wrapper in (lambda m: DDPBucketed(m, 1e-9), DDPIndividualParameters):
        ddp = wrapper(kit.build_model("mlp", SEED))
        loss = kit.summed_loss("mlp", ddp(x), y)
        loss.backward(retain_graph=True)
        ddp.finish_gradient_synchronization()  # first step: launch order learned
        loss.backward(retain_graph=True)
        messages = []
        try:
            ddp(x)
        except RuntimeError as error:
            messages.append(str(error))
        try:
            loss.backward()
        except RuntimeError as error:
            messages.append(str(error))
        ddp.finish_gradient_synchronization()  # wait for what did go out
        out["errors"][type(ddp).__name__] = messages
    return out


def test_construction_checks_views_and_misuse_errors(world_size):
    results = run_ranks(_guards_rank, world_size, timeout=120)
    source = kit.snapshot(kit.build_model("mlp", SEED + world_size - 1))
    for rank, got in enumerate(results):
        if world_size > 1:
            assert len(got["mismatch"]) == 3 * len(MUTATIONS)
            for (mutation, wrapper), message in got["mismatch"].items():
                name, detail = MUTATIONS[mutation]
                assert message is not None, f"rank {rank}: {mutation} via {wrapper} not detected"
                assert f"rank {world_size - 1}" in message and name in message, message
                assert detail in message, message
        kit.assert_matches(got["broadcast"] | {"grad_is_none": {}},
                           source | {"grad_is_none": {}}, f"broadcast rank {rank}", tol=0.0)
        assert got["views_ok"] == [True, True, True]
        flat_names = [n for names in got["bucket_names"] for n in names]
        assert sorted(flat_names) == sorted(
            ["layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias", "unused"]
        )  # frozen_scale is left out
        assert got["bucket_counts"]["bucketed_tiny"] == 5
        assert 2 <= got["bucket_counts"]["bucketed_few"] <= 4
        assert got["bucket_counts"]["bucketed_one"] == 1
        stats = got["stats"]
        assert stats.launched_in_backward + stats.launched_in_finish == len(got["bucket_names"])
        assert 0.0 <= stats.wait_seconds <= stats.finish_seconds
        for wrapper, messages in got["errors"].items():
            assert len(messages) == 2, (wrapper, messages)
            assert wrapper in messages[0] and wrapper in messages[1]
            assert "finish_gradient_synchronization" in messages[0]
            assert "after its" in messages[1]


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf")])
def test_bucket_size_must_be_positive(bad):
    with pytest.raises(ValueError, match="bucket_size_mb"):
        DDPBucketed(torch.nn.Linear(2, 2), bad)
