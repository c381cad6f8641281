"""``--precision fp8`` on Gloo ranks (float8 emulated on the CPU): the blocks' float8 products
compose with zero1, zero2, zero3 and FSDP2, and with compiled, checkpointed blocks.

The oracle is the same ranks under a DDP wrapper: every rank computes its own slice of the
batch with the same float8 scales whatever the sharding (tensorwise scales are one per
tensor of a rank's micro-batch), so the kinds differ only in how the gradients are summed,
as they do in bf16. One process on the whole batch scales over the whole batch instead:
against it, the losses agree to the float8 rounding, not to the last bit."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lab2_testing.ddp_testkit import relative_error
from lab2_testing.dist import run_ranks
from lab2_trainer.config import ModelConfig, TrainSettings
from lab2_trainer.runtime.launch import DistContext
from lab2_trainer.training.loop import Trainer

torch.set_num_threads(1)

#: Each kind's run beside the DDP one (the last: compiled blocks, checkpointed inside).
KINDS = {"zero1": dict(sharding="zero1"), "zero2": dict(sharding="zero2"),
         "zero3": dict(sharding="zero3"), "fsdp": dict(sharding="fsdp"),
         "zero3-compiled": dict(sharding="zero3", compile=True, compile_backend="aot_eager",
                                activation_checkpointing="selective", fp8_recipe="rowwise")}


def fp8_settings(data, out, **overrides) -> TrainSettings:
    model = ModelConfig(context_length=16, d_model=32, n_layers=2, n_heads=2, d_ff=64,
                        norm="torch")
    # 24 sequences split evenly over 1-4 ranks.
    fields = dict(model=model, data=str(data), steps=4, batch_size=24, lr=1e-2, min_lr=1e-3,
                  warmup=2, eval_every=0, eval_batches=1, out=str(out), sample_tokens=0,
                  quiet=True, plot=False, ddp="none", sharding="none", seed=0, clip=0.5,
                  precision="fp8")
    fields.update(overrides)
    return TrainSettings(**fields)


def params_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    state = trainer.parallel.full_model_state(trainer.ctx.rank)  # a collective when sharded
    return {k: v.detach().cpu().clone() for k, v in (state or {}).items()}


def losses(out) -> list[float]:
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines)]


def _fp8_rank(rank, world_size, data, out):
    ctx = DistContext.from_process_group()
    got = {}
    runs = {"ddp": dict(ddp="bucketed"),
            "ddp-rowwise": dict(ddp="bucketed", fp8_recipe="rowwise"), **KINDS}
    for name, extra in runs.items():
        trainer = Trainer(fp8_settings(data, f"{out}/{name}", **extra).validate(world_size), ctx)
        trainer.run()
        got[name] = params_of(trainer)
    return got


def test_float8_blocks_compose_with_every_sharding_kind(world_size, corpus_dir, tmp_path):
    whole = Trainer(fp8_settings(corpus_dir, tmp_path / "whole").validate(1), DistContext())
    whole.run()
    ranks = tmp_path / "ranks"
    got = run_ranks(_fp8_rank, world_size, str(corpus_dir), str(ranks), timeout=420)[0]
    for name, extra in KINDS.items():
        oracle = "ddp-rowwise" if extra.get("fp8_recipe") == "rowwise" else "ddp"
        # The sums' order differs, which now and then moves a value across a float8
        # rounding boundary, and that value by a float8 step (6%): 3e-4 seen at 4 ranks,
        # far below the float8 error itself (about 5%); gradients not averaged, or averaged
        # twice, would be off by tens of percent.
        assert relative_error(got[oracle], got[name]) < 3e-3, name
        for ours, theirs in zip(losses(ranks / name), losses(ranks / oracle), strict=True):
            assert abs(ours - theirs) < 1e-3 * theirs, (name, ours, theirs)
    # One process on the whole batch: the same run, up to where the scales are taken.
    for ours, theirs in zip(losses(ranks / "ddp"), losses(tmp_path / "whole"), strict=True):
        assert abs(ours - theirs) < 5e-3 * theirs, (ours, theirs)
