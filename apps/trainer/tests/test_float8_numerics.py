"""``--precision fp8``'s numerics at reduced width, against bf16 and a float64 reference:
the blocks' output, the logits and the gradients (norm-relative error), and a few training
steps' loss against bf16's, with compilation and activation checkpointing.

Each test runs on the CPU, where torchao emulates the float8 products in float32 (the same
casts and scales), and on a CUDA GPU of compute capability 8.9 or later with the real
float8 kernels (skipped without one).

The tolerances, from the formats' rounding. e4m3 keeps 3 mantissa bits: round to nearest
is off by at most 2^-4 (6.3%) of a value, about 2^-4 / sqrt(3) = 3.6% in RMS; e5m2, which
tensorwise uses for the output gradient, 2^-3 and 7.2%. A product of two rounded operands
then carries about sqrt(2) x 3.6% = 5.1% (e4m3 x e4m3, the forward, and rowwise
throughout) and sqrt(3.6^2 + 7.2^2) = 8.1% (e5m2 x e4m3, tensorwise's backward) of
norm-relative error, with fp32 accumulation adding nothing of that size; two blocks
compound it a little. Measured with the emulation (seeds 0-2, width 128): the blocks'
output 5.7% (both recipes), the blocks' weight gradients 9.4% (tensorwise) and 6.7%
(rowwise); bf16, 8 mantissa bits, 0.45% and 0.6%. The bounds are about twice the
estimates; the logits pass through the LM head, which stays in bf16, and the embedding,
which is exact, so their error is bf16's (0.3%) plus the blocks' small share. Each float8
error must also exceed bf16's bound: the products really ran in float8.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lab2_testing.tn_numerics import rel_err
from lab2_trainer.config import ModelConfig, TrainSettings, model_config
from lab2_trainer.models.float8 import MIN_CAPABILITY, convert_blocks, float8_modules
from lab2_trainer.models.transformer import TransformerLM
from lab2_trainer.runtime.launch import DistContext
from lab2_trainer.training.loop import Trainer
from lab2_trainer.training.step import backward_thread

torch.set_num_threads(1)


def float8_gpu() -> bool:
    """A CUDA GPU with float8 tensor cores (compute capability 8.9 or later)."""
    return (torch.cuda.is_available()
            and tuple(torch.cuda.get_device_capability(0)) >= MIN_CAPABILITY)


#: The CPU (emulated float8) always; a GPU when there is one with float8 tensor cores.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not float8_gpu(), reason="needs a CUDA GPU of compute capability 8.9 or later"))]

#: Norm-relative error bounds against float64 (the module docstring derives them).
BLOCKS_TOL = {"bf16": 1e-2, "tensorwise": 0.12, "rowwise": 0.12}
LOGITS_TOL = {"bf16": 1e-2, "tensorwise": 2e-2, "rowwise": 2e-2}
GRAD_TOL = {"bf16": 2e-2, "tensorwise": 0.2, "rowwise": 0.15}
#: Training: a few steps' loss of fp8 within this fraction of bf16's.
LOSS_TOL = 0.02


def small_config() -> ModelConfig:
    """Width 128 (a multiple of 16, as float8 products need), two blocks, SwiGLU."""
    return model_config("tiny", d_model=128, d_ff=384, n_layers=2, n_heads=4,
                        context_length=64, vocab_size=256, norm="torch")


def forward_backward(model: TransformerLM, x: torch.Tensor, y: torch.Tensor,
                     autocast: bool) -> dict[str, torch.Tensor]:
    """Logits, the blocks' output (the residual stream after the last block minus the
    embedding: what float8 computes) and every parameter's gradient, in float64 on the
    CPU."""
    captured = {}
    hook = model.blocks[-1].register_forward_hook(
        lambda module, args, out: captured.__setitem__("out", out))
    device = x.device.type
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        embedded = model.embed(x)[0]
        logits, loss = model(x, y)
    hook.remove()
    model.zero_grad(set_to_none=True)
    with backward_thread("caller"):  # as the trainer runs it (and later tests fork safely)
        loss.backward()
    stream, pending = captured["out"]
    result = {"logits": logits, "blocks": stream.double() + pending.double() - embedded.double()}
    result.update({name: p.grad for name, p in model.named_parameters()})
    return {k: v.detach().double().cpu() for k, v in result.items()}


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=3)
@given(seed=st.integers(0, 2**31 - 1))
def test_float8_blocks_logits_and_gradients_against_float64(device, seed):
    config = small_config()
    base = TransformerLM(config, seed=seed % 1000)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (8, config.context_length + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    reference = forward_backward(copy.deepcopy(base).double(), x, y, autocast=False)
    runs = {"bf16": copy.deepcopy(base).to(device)}
    for recipe in ("tensorwise", "rowwise"):
        model = copy.deepcopy(base).to(device)
        assert len(convert_blocks(model, recipe)) == 5 * config.n_layers
        runs[recipe] = model
    matrices = [n for n in reference if ".attn." in n or ".ffn." in n]
    for name, model in runs.items():
        got = forward_backward(model, x.to(device), y.to(device), autocast=True)
        blocks = rel_err(got["blocks"], reference["blocks"])
        logits = rel_err(got["logits"], reference["logits"])
        grads = max(rel_err(got[n], reference[n]) for n in matrices)
        others = max(rel_err(got[n], reference[n]) for n in reference
                     if n not in matrices and n not in ("logits", "blocks"))
        assert blocks < BLOCKS_TOL[name], (name, blocks)
        assert logits < LOGITS_TOL[name], (name, logits)
        assert grads < GRAD_TOL[name], (name, grads)
        assert others < GRAD_TOL[name], (name, others)
        if name != "bf16":  # the products ran in float8, not in bf16
            assert blocks > BLOCKS_TOL["bf16"] and grads > GRAD_TOL["bf16"], (name, blocks,
                                                                               grads)


def train_settings(data: Path, out: Path, device: str, **overrides) -> TrainSettings:
    """A short real run: the CPU's at width 64, the GPU's at width 256, at the trainer's
    learning rate for the width (at 1e-2, too high for width 256, bf16's and fp8's losses
    drift 1% apart in 24 steps, emulated; at the rule's 1.6e-3, 0.01%)."""
    width = 256 if device == "cuda" else 64
    model = ModelConfig(context_length=64, d_model=width, n_layers=2, n_heads=4,
                        d_ff=3 * width, norm="torch")
    fields = dict(model=model, data=str(data), steps=24, batch_size=16, warmup=4,
                  eval_every=0, eval_batches=4, out=str(out), sample_tokens=0, quiet=True,
                  plot=False, ddp="none", sharding="none", seed=0, precision="bf16",
                  compile=False)
    fields.update(overrides)
    return TrainSettings(**fields).validate(1)


def last_losses(out: Path, n: int = 6) -> float:
    records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    return sum(r["loss"] for r in records[-n:]) / n


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_float8_training_follows_bf16_with_compilation_and_checkpointing(device, corpus_dir,
                                                                         tmp_path):
    # The GPU compiles with inductor (the trainer's default), the CPU with aot_eager: the
    # same traced graphs, without a C compiler.
    backend = "inductor" if device == "cuda" else "aot_eager"
    ctx = DistContext(device=torch.device(device))
    runs = {"bf16": {},
            "tensorwise": dict(precision="fp8", fp8_recipe="tensorwise", compile=True,
                               compile_backend=backend, activation_checkpointing="selective"),
            "rowwise": dict(precision="fp8", fp8_recipe="rowwise", compile=True,
                            compile_backend=backend, activation_checkpointing="full")}
    loss, val = {}, {}
    for name, extra in runs.items():
        out = tmp_path / name
        trainer = Trainer(train_settings(corpus_dir, out, device, **extra), ctx)
        if name != "bf16":  # converted first, then compiled
            assert trainer.model.regions_compiled
            assert len(float8_modules(trainer.model)) == 5 * trainer.s.model.n_layers
        summary = trainer.run()
        loss[name], val[name] = last_losses(out), summary["final_val_loss"]
        torch._dynamo.reset()
    first = json.loads((tmp_path / "bf16" / "metrics.jsonl").open().readline())["loss"]
    assert loss["bf16"] < first - 0.5, "bf16 did not learn: the comparison would be empty"
    for name in ("tensorwise", "rowwise"):
        assert abs(loss[name] - loss["bf16"]) < LOSS_TOL * loss["bf16"], (name, loss)
        assert abs(val[name] - val["bf16"]) < LOSS_TOL * val["bf16"], (name, val)


@pytest.mark.slow
@pytest.mark.skipif(not float8_gpu(), reason="needs a CUDA GPU of compute capability 8.9+")
def test_float8_on_a_gpu_composes_with_zero3_and_fsdp(corpus_dir, tmp_path):
    # One rank of NCCL: zero3's and FSDP2's hooks, gathers and flat shards around the real
    # float8 kernels, against the same run unsharded (the Gloo tests hold every world size,
    # with float8 emulated).
    import torch.distributed as dist

    from lab2_testing.ddp_testkit import relative_error

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ctx = DistContext(device=torch.device("cuda", 0))
        got = {}
        for kind in ("none", "zero3", "fsdp"):
            trainer = Trainer(train_settings(corpus_dir, tmp_path / kind, "cuda", steps=6,
                                             precision="fp8", sharding=kind, compile=True,
                                             activation_checkpointing="full"), ctx)
            trainer.run()
            state = trainer.parallel.full_model_state(0)
            got[kind] = {k: v.detach().float().cpu() for k, v in state.items()}
            torch._dynamo.reset()
    finally:
        dist.destroy_process_group()
    for kind in ("zero3", "fsdp"):
        assert relative_error(got["none"], got[kind]) < 1e-3, kind
