"""``--activation-checkpointing``: full and selective recompute change what the backward
keeps, never the results. One process (eager and compiled, every norm kind) and Gloo ranks
with the DDP wrapper and the sharding kinds give the losses of ``none``; gradient hooks fire
once per parameter and backward; HFU counts the recomputed forwards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lab2_testing.dist import run_ranks
from lab2_trainer.config import ModelConfig, TrainSettings
from lab2_trainer.models.activation_checkpointing import recomputed_blocks, selective_kind
from lab2_trainer.models.shapes import block_matmul_parameters, flops_per_token
from lab2_trainer.models.transformer import TransformerLM
from lab2_trainer.reporting.report import recompute_flops_per_token
from lab2_trainer.runtime.launch import DistContext
from lab2_trainer.training.loop import Trainer

torch.set_num_threads(1)

KINDS = ("full", "selective")


def tiny_settings(data, out, **overrides) -> TrainSettings:
    norm = overrides.pop("norm", "torch")
    model = ModelConfig(context_length=16, d_model=32, n_layers=3, n_heads=2, d_ff=64,
                        norm=norm)
    fields = dict(model=model, data=str(data), steps=4, batch_size=24, lr=1e-2, min_lr=1e-3,
                  warmup=2, eval_every=0, eval_batches=1, out=str(out), sample_tokens=0,
                  quiet=True, plot=False, ddp="none", sharding="none", seed=0, bucket_mb=0.002)
    fields.update(overrides)
    return TrainSettings(**fields)


def curve(out) -> list[tuple[float, float]]:
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return [(r["loss"], r["grad_norm"]) for r in map(json.loads, lines)]


def assert_same_curve(got, want, rtol=1e-6):
    assert len(got) == len(want)
    for (loss, norm), (ref_loss, ref_norm) in zip(got, want):
        assert abs(loss - ref_loss) <= rtol * abs(ref_loss), (got, want)
        assert abs(norm - ref_norm) <= 10 * rtol * abs(ref_norm), (got, want)


@pytest.mark.parametrize("norm", ["torch", "tritonnorm", "layernorm"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_checkpointing_keeps_the_loss_curve_of_none(corpus_dir, tmp_path, norm, precision):
    runs = {}
    for kind in ("none", *KINDS):
        out = tmp_path / kind
        s = tiny_settings(corpus_dir, out, norm=norm, precision=precision, grad_accum=2,
                          activation_checkpointing=kind).validate(1)
        Trainer(s, DistContext()).run()
        runs[kind] = curve(out)
    for kind in KINDS:
        assert_same_curve(runs[kind], runs["none"], rtol=1e-6 if precision == "fp32" else 1e-3)


def test_checkpointing_composes_with_compile(corpus_dir, tmp_path):
    runs = {}
    for kind in ("none", *KINDS):
        out = tmp_path / kind
        s = tiny_settings(corpus_dir, out, steps=2, compile=True, compile_backend="aot_eager",
                          activation_checkpointing=kind).validate(1)
        Trainer(s, DistContext()).run()
        runs[kind] = curve(out)
    for kind in KINDS:
        assert_same_curve(runs[kind], runs["none"], rtol=1e-5)


@pytest.mark.parametrize("kind", ["none", *KINDS])
def test_every_parameter_gets_its_gradient_once_per_backward(kind):
    # The DDP wrappers and zero1 reduce from post-accumulate-grad hooks: a recompute that
    # accumulated again would reduce twice.
    config = ModelConfig(context_length=8, d_model=16, n_layers=3, n_heads=2, d_ff=32,
                         norm="tritonnorm")
    model = TransformerLM(config, activation_checkpointing=kind)
    calls: dict[str, int] = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda _p, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    x = torch.randint(0, config.vocab_size, (2, 8))
    for _ in range(2):
        model(x, x)[1].backward()
    assert calls == {name: 2 for name, _ in model.named_parameters()}


def test_checkpointing_is_off_without_gradients_and_refuses_unknown_kinds():
    config = ModelConfig(context_length=8, d_model=16, n_layers=2, n_heads=2, d_ff=32)
    model = TransformerLM(config, activation_checkpointing="full")
    with torch.no_grad():
        model.generate(torch.zeros(1, 1, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="activation checkpointing must be one of"):
        TransformerLM(config, activation_checkpointing="some")
    with pytest.raises(ValueError, match="--activation-checkpointing must be one of"):
        tiny_settings(".", ".", activation_checkpointing="some").validate(1)


def test_hfu_counts_one_more_forward_of_the_blocks_for_full():
    config = ModelConfig(context_length=16, d_model=32, n_layers=3, n_heads=2, d_ff=64)
    per_block = 2 * block_matmul_parameters(config) + 4 * 32 * 16
    assert recompute_flops_per_token(config, "none") == 0
    assert recompute_flops_per_token(config, "full") == 3 * per_block
    assert recompute_flops_per_token(config, "selective") == (
        0 if selective_kind() == "op" else recomputed_blocks("selective", 3) * per_block)
    for kind in ("none", "full"):  # the planner's count is the trainer's
        model_flops, hardware = flops_per_token(config, kind)
        assert hardware - model_flops == recompute_flops_per_token(config, kind)


def _ranks(rank, world_size, data, out):
    ctx = DistContext.from_process_group()
    curves = {}
    for sharding, ddp in (("zero1", "none"), ("zero2", "none"), ("fsdp", "none"),
                          ("zero1-allreduce", "bucketed"), ("torch", "torch")):
        for kind in KINDS:
            name = f"{sharding}-{kind}"
            s = tiny_settings(data, f"{out}/{name}", sharding=sharding, ddp=ddp,
                              activation_checkpointing=kind, clip=0.05).validate(world_size)
            Trainer(s, ctx).run()
            if rank == 0:
                curves[name] = curve(f"{out}/{name}")
    return curves


def test_checkpointing_on_ranks_matches_one_process_without_it(world_size, corpus_dir,
                                                                tmp_path):
    ref = tmp_path / "ref"
    Trainer(tiny_settings(corpus_dir, ref, clip=0.05).validate(1), DistContext()).run()
    want = curve(ref)
    got = run_ranks(_ranks, world_size, str(corpus_dir), str(tmp_path / "ranks"),
                    timeout=400)[0]
    assert len(got) == 10
    for name, losses in got.items():
        assert_same_curve(losses, want, rtol=1e-5), name


def test_trainer_reports_hfu_beside_mfu(corpus_dir, tmp_path):
    from lab2_trainer.reporting.report import Peak

    s = tiny_settings(corpus_dir, tmp_path, steps=1, activation_checkpointing="full")
    trainer = Trainer(s.validate(1), DistContext())
    trainer.peak = Peak("a test peak", 1e12)  # the CPU has none
    figures = trainer.throughput([(2, 1.0)])
    ratio = trainer.hardware_flops_per_token / trainer.flops_per_token
    assert ratio > 1.2
    assert figures["hfu"] == pytest.approx(figures["mfu"] * ratio)
    assert "activation checkpointing full" in trainer.setup_line()
    assert "HFU" in trainer.describe(1.0)


def test_selective_falls_back_to_every_other_block_without_the_policy_api(monkeypatch):
    import lab2_trainer.models.activation_checkpointing as ac

    monkeypatch.setattr(ac, "has_op_policy", lambda: False)
    monkeypatch.setattr(ac, "_warned", False)
    assert ac.selective_kind() == "every-other-block"
    assert recomputed_blocks("selective", 3) == 2
    config = ModelConfig(context_length=8, d_model=16, n_layers=3, n_heads=2, d_ff=32)
    x = torch.randint(0, config.vocab_size, (2, 8))
    grads = {}
    for kind in ("none", "selective"):
        if kind == "selective":  # said when the model is set up, before any step
            with pytest.warns(UserWarning, match="every other block"):
                model = TransformerLM(config, activation_checkpointing=kind)
            assert [b.checkpointing for b in model.blocks] == ["full", "none", "full"]
        else:
            model = TransformerLM(config, activation_checkpointing=kind)
        loss = model(x, x)[1]
        loss.backward()
        grads[kind] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert torch.equal(grads["none"], grads["selective"])
