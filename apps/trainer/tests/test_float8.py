"""``--precision fp8`` on the CPU: which modules become torchao's ``Float8Linear``, that the
state dict stays nn.Linear's (checkpoints, export, resuming across precisions), fp8's rules
and their one-line refusals through ``lab2-train``, the planner's fp8 and the run's labels.
The float8 products are torchao's emulation here; their numerics against float64, and on a
GPU, are ``test_float8_numerics.py``'s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from lab2_testing.cli import refused_here
from lab2_testing.ddp_testkit import relative_error
from lab2_trainer.checkpoint.export import export
from lab2_trainer.cli.main import main
from lab2_trainer.config import FP8_RECIPES, ModelConfig, TrainSettings, model_config
from lab2_trainer.models.float8 import (
    convert_blocks,
    device_problem,
    float8_config,
    float8_modules,
    run_problem,
    shape_problem,
)
from lab2_trainer.models.shapes import parameter_counts
from lab2_trainer.models.transformer import TransformerLM
from lab2_trainer.parallel.parallelize import parallelize
from lab2_trainer.planner.layout import recommend
from lab2_trainer.planner.plan import Hardware, PlanInput, memory_items, plan
from lab2_trainer.reporting.report import precision_text
from lab2_trainer.runtime.launch import DistContext
from lab2_trainer.training.loop import Trainer
from lab2_trainer.training.step import backward_thread

torch.set_num_threads(1)
Float8Linear = pytest.importorskip("torchao.float8.float8_linear").Float8Linear
ScalingGranularity = pytest.importorskip("torchao.float8").ScalingGranularity


def small(**fields) -> ModelConfig:
    return model_config("tiny", **{**dict(d_model=32, d_ff=64, n_layers=2, n_heads=2,
                                          context_length=16, vocab_size=64), **fields})


# ------------------------------------------------------------------------- conversion
@pytest.mark.parametrize("recipe", FP8_RECIPES)
@pytest.mark.parametrize("ffn", ["swiglu", "gelu"])
def test_the_blocks_linears_become_float8_and_nothing_else(recipe, ffn):
    model = TransformerLM(small(ffn=ffn, vocab_size=50), seed=0)  # a head of no 16-multiple
    before = {name: id(p) for name, p in model.named_parameters()}
    converted = convert_blocks(model, recipe)
    own = ["attn.qkv", "attn.proj", "ffn.w1", "ffn.w2"] + (["ffn.w3"] if ffn == "swiglu" else [])
    expected = [f"blocks.{i}.{name}" for i in range(2) for name in own]
    assert sorted(converted) == sorted(expected) == sorted(float8_modules(model))
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            assert isinstance(module, Float8Linear) == (name in expected), name
    assert type(model.lm_head) is nn.Linear and type(model.tok_emb) is nn.Embedding
    # The same Parameter objects: an optimizer or a sharding built later sees plain weights.
    assert {name: id(p) for name, p in model.named_parameters()} == before
    granularity = model.blocks[0].ffn.w1.config.cast_config_weight.scaling_granularity
    assert granularity == (ScalingGranularity.TENSORWISE if recipe == "tensorwise"
                           else ScalingGranularity.AXISWISE)
    assert model.blocks[0].attn.qkv.config.emulate  # on the CPU


def test_a_float8_model_has_nn_linears_state_dict_both_ways():
    plain = TransformerLM(small(), seed=1)
    fp8 = TransformerLM(small(), seed=2)
    convert_blocks(fp8, "tensorwise")
    ours, theirs = fp8.state_dict(), plain.state_dict()
    assert list(ours) == list(theirs)
    assert all(ours[k].shape == theirs[k].shape and ours[k].dtype == theirs[k].dtype
               and type(ours[k]) is torch.Tensor for k in ours)
    plain.load_state_dict(ours)  # strict: no key missing, none left over
    assert all(torch.equal(plain.state_dict()[k], ours[k]) for k in ours)
    other = TransformerLM(small(), seed=3)
    fp8.load_state_dict(other.state_dict())
    assert all(torch.equal(fp8.state_dict()[k], v) for k, v in other.state_dict().items())


def test_parallelize_converts_the_bare_model_and_its_optimizer_steps_the_same_weights():
    # Compiled and checkpointed too: test_float8_numerics.py's training (compiling here would
    # leave autograd's threads started in this process, where later tests fork ranks).
    model = TransformerLM(small(), seed=0, activation_checkpointing="selective")
    p = parallelize(model, sharding="none", ddp="none", device=torch.device("cpu"), lr=1e-3,
                    betas=(0.9, 0.95), weight_decay=0.1, float8="rowwise")
    assert len(float8_modules(p.model)) == 10
    assert {id(q) for g in p.optimizer.param_groups for q in g["params"]} == \
        {id(q) for q in model.parameters()}
    x = torch.randint(0, 64, (2, 16))
    with backward_thread("caller"), torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = p(x, x)
        loss.backward()
    assert all(q.grad is not None and torch.isfinite(q.grad).all() for q in model.parameters()
               if q.requires_grad)


def test_a_shape_float8_products_cannot_take_is_refused_by_the_conversion():
    model = TransformerLM(small(d_model=40, d_ff=64), seed=0)
    with pytest.raises(ValueError, match="multiples of 16"):
        convert_blocks(model, "tensorwise")
    assert float8_modules(model) == []  # nothing half-converted
    with pytest.raises(ValueError, match="fp8 recipe must be one of tensorwise, rowwise"):
        float8_config("blockwise")
    with pytest.raises(ValueError, match="float8 products need a CUDA device"):
        convert_blocks(TransformerLM(small(), seed=0), "tensorwise", emulate=False)


# ------------------------------------------------------------------------------ rules
@given(d_model=st.integers(1, 4096), d_ff=st.integers(1, 16384), tokens=st.integers(1, 10**6))
def test_shape_rule_is_multiples_of_16(d_model, d_ff, tokens):
    config = ModelConfig(d_model=d_model, d_ff=d_ff, n_heads=1)
    problem = shape_problem(config, tokens)
    fits = d_model % 16 == 0 and d_ff % 16 == 0 and tokens % 16 == 0
    assert (problem is None) == fits, problem
    if not fits:
        assert problem.startswith("--precision fp8 needs") and "\n" not in problem
    assert (shape_problem(config) is None) == (d_model % 16 == 0 and d_ff % 16 == 0)


def test_every_preset_takes_float8_and_tensor_parallelism_does_not():
    from lab2_trainer.config import PRESETS

    for preset in PRESETS:
        assert run_problem(model_config(preset), 32 * 512, 1) is None, preset
    assert "--tp 2 is not supported" in run_problem(model_config("small"), 1024, 2)
    assert "this run is on the CPU" in device_problem("cpu")


def test_an_unknown_recipe_is_refused_by_the_settings():
    with pytest.raises(ValueError, match="--fp8-recipe must be one of tensorwise, rowwise"):
        TrainSettings(fp8_recipe="blockwise").check()


#: A tiny run's flags (the tokens of a micro-batch, 2 x 32, a multiple of 16).
B = ["--steps", "3", "--batch-size", "4", "--d-model", "32", "--n-layers", "1", "--n-heads",
     "2", "--d-ff", "64", "--context-length", "32", "--eval-batches", "1", "--eval-every", "0",
     "--sample-tokens", "0", "--no-plot", "--quiet"]


@pytest.mark.parametrize("extra, fragments", [
    ([], ("--precision fp8 needs a CUDA GPU of compute capability 8.9", "on the CPU")),
    (["--d-model", "40"], ("needs --d-model to be a multiple of 16", "got 40")),
    (["--d-ff", "72"], ("needs --d-ff to be a multiple of 16", "got 72")),
    (["--nproc", "1", "--batch-size", "1", "--context-length", "24"],
     ("tokens of a micro-batch", "got 24")),
    (["--nproc", "2", "--tp", "2"], ("--precision fp8 with --tp 2 is not supported",)),
    (["--fp8-recipe", "blockwise"], ("--fp8-recipe", "invalid choice")),
], ids=["cpu", "d-model", "d-ff", "tokens", "tp", "recipe"])
def test_lab2_train_refuses_fp8_in_one_line_before_any_rank(capsys, monkeypatch, tmp_path,
                                                            extra, fragments):
    refused_here(capsys, monkeypatch, [*B, "--precision", "fp8", *extra], tmp_path / "run",
                 *fragments)


# ------------------------------------------------------------- planner and labels
def test_the_planner_runs_the_blocks_products_at_the_float8_rate():
    # The run --fp8-efficiency was fitted to: xl 16 x 512 (vocabulary 10000) tensorwise,
    # compiled, on one H100, 1.16x bf16's tokens/s (in-sample by construction).
    config = model_config("xl", vocab_size=10000)
    bf16, fp8 = (plan(PlanInput(config, batch_size=16, precision=p, compile=True))
                 for p in ("bf16", "fp8"))
    ratio = fp8["time"]["tokens_per_s"] / bf16["time"]["tokens_per_s"]
    assert ratio == pytest.approx(1.16, abs=0.01)
    assert any("fp8: the blocks' matrix products" in a for a in fp8["assumptions"])
    # At the float8 peak itself (no casts, no scales) the blocks' products run twice as
    # fast: the speed-up nears 2x, short of it by attention's and the head's share.
    ideal = plan(PlanInput(config, batch_size=16, precision="fp8", compile=True,
                           hardware=Hardware(fp8_efficiency=Hardware().efficiency)))
    assert 1.8 < ideal["time"]["tokens_per_s"] / bf16["time"]["tokens_per_s"] < 2
    with pytest.raises(ValueError, match="--fp8-efficiency must be in"):
        PlanInput(config, batch_size=16, hardware=Hardware(fp8_efficiency=1.5)).validate()
    config = model_config("xl")
    # Eager fp8 keeps the fp32 weight for the backward: the head's bf16 copy alone.
    eager = {p: memory_items(PlanInput(config, batch_size=8, precision=p,
                                       compile=False).validate())
             for p in ("bf16", "fp8")}
    counts = parameter_counts(config)
    head = counts["matmul"] - config.n_layers * counts["block_matmul"]  # and the norms' vectors
    assert head < 1.5 * config.vocab_size * config.d_model
    assert eager["fp8"]["half-precision weight copies"] == 2 * head
    assert eager["bf16"]["half-precision weight copies"] == 2 * counts["matmul"]
    with pytest.raises(ValueError, match="--tp 2 is not supported"):
        PlanInput(model_config("large"), batch_size=32, gpus_per_node=2, tp=2,
                  precision="fp8").validate()
    # --recommend weighs no tensor-parallel layout for fp8.
    rows = recommend(PlanInput(model_config("large"), batch_size=64, gpus_per_node=4,
                               precision="fp8"))["rows"]
    assert rows and {r["tp"] for r in rows} == {1}


def test_the_run_shows_the_recipe_beside_the_precision():
    settings = {"precision": "fp8", "fp8_recipe": "rowwise", "compile": True,
                "compile_scope": "blocks", "auto": "compile"}
    assert precision_text(settings) == "fp8 (rowwise), compile blocks (auto)"
    assert precision_text({**settings, "precision": "bf16"}) == "bf16, compile blocks (auto)"


# ------------------------------------------------------------------------ checkpoints
def run_settings(data: Path, out: Path, **overrides) -> TrainSettings:
    model = ModelConfig(context_length=32, d_model=32, n_layers=2, n_heads=2, d_ff=64)
    fields = dict(model=model, data=str(data), steps=4, batch_size=8, lr=1e-2, min_lr=1e-3,
                  warmup=2, eval_every=0, eval_batches=1, out=str(out), sample_tokens=8,
                  quiet=True, plot=False, ddp="none", sharding="none", seed=0)
    fields.update(overrides)
    return TrainSettings(**fields).validate(1)


@pytest.mark.slow
def test_fp8_checkpoints_are_plain_weights_and_resume_across_precisions(
        corpus_dir, tmp_path, capsys, monkeypatch):
    fp8_run = Trainer(run_settings(corpus_dir, tmp_path / "fp8", precision="fp8",
                                   fp8_recipe="rowwise"), DistContext())
    summary = fp8_run.run()
    assert "fp8 (rowwise)" in summary["setup"]
    saved = json.loads((tmp_path / "fp8" / "summary.json").read_text())["settings"]
    assert (saved["precision"], saved["fp8_recipe"]) == ("fp8", "rowwise")
    # Exported, the step folder is a plain state dict a bf16 or fp32 model loads.
    export(tmp_path / "fp8", tmp_path / "fp8.pt")
    state = torch.load(tmp_path / "fp8.pt", weights_only=True)["model"]
    plain = TransformerLM(fp8_run.s.model)
    plain.load_state_dict(state)
    trained = {k: v.detach() for k, v in fp8_run.model.state_dict().items()}
    assert relative_error(trained, plain.state_dict()) == 0
    # fp8 -> bf16 and bf16 -> fp8, from the step folders, resume and train on.
    back = Trainer(run_settings(corpus_dir, tmp_path / "fp8", steps=6, precision="bf16",
                                resume=str(tmp_path / "fp8")), DistContext())
    assert back.step == 4 and float8_modules(back.model) == []
    assert relative_error(trained, back.model.state_dict()) == 0
    back.run()
    Trainer(run_settings(corpus_dir, tmp_path / "bf16", precision="bf16"), DistContext()).run()
    onward = Trainer(run_settings(corpus_dir, tmp_path / "bf16", steps=6, precision="fp8",
                                  resume=str(tmp_path / "bf16")), DistContext())
    assert onward.step == 4 and len(float8_modules(onward.model)) == 10
    onward.run()
    # Through lab2-train: the fp8 run's checkpoint resumes in fp32 on this CPU, and the CPU
    # refuses to resume the bf16 one in fp8.
    monkeypatch.chdir(tmp_path)
    assert main(["--resume", str(tmp_path / "fp8"), "--precision", "fp32", "--steps", "8",
                 "--nproc", "1"]) == 0
    capsys.readouterr()
    refused_here(capsys, monkeypatch, ["--resume", str(tmp_path / "bf16"), "--precision",
                                       "fp8", "--steps", "8", "--nproc", "1"],
                 tmp_path / "elsewhere", "--precision fp8 needs a CUDA GPU")
