"""Sharded checkpoints across kinds and world sizes, on Gloo ranks.

In the cell of world size W, every ``--sharding`` kind trains 4 steps at W, saving at
steps 2 and 4 (each rank its own part, nothing gathered). Then:

* the same kind at W resumes from step 2: steps 3 and 4 have bit for bit the losses of the
  uninterrupted run, and its step-4 checkpoint is bit for bit the same;
* every kind at M = W % 4 + 1 ranks loads another kind's step-2 checkpoint and saves it
  again at once: its export (the whole state, one file) is bit for bit the source's.
  Over the four cells every world size 1-4 saves, and loads at its own size and at
  another (other kinds at the same size: ``test_train_sharding_gloo``).

zero1's stage 3 (``shard_model``, ``Stage3Optimizer``; not a trainer kind yet) saves its
shards the same way: the export, and a fresh stage-3 model loading them, hold bit for bit
the state the ranks had.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lab2_testing.dist import run_ranks
from lab2_testing.trainer_state import bare_trainer_state, same_model_and_optimizer
from lab2_trainer.checkpoint.export import export
from lab2_trainer.config import ModelConfig, TrainSettings
from lab2_trainer.runtime.launch import DistContext
from lab2_trainer.training.loop import Trainer

torch.set_num_threads(1)

KINDS = ("none", "zero1", "zero2", "zero1-allreduce", "torch", "fsdp")


def settings(data, out, sharding: str, **overrides) -> TrainSettings:
    model = ModelConfig(context_length=16, d_model=32, n_layers=2, n_heads=2, d_ff=64,
                        norm="torch")
    self_reducing = sharding in ("zero1", "zero2", "fsdp")
    fields = dict(model=model, data=str(data), steps=4, batch_size=24, lr=1e-2, min_lr=1e-3,
                  warmup=2, eval_every=0, eval_batches=1, out=str(out), sample_tokens=0,
                  quiet=True, plot=False, sharding=sharding,
                  ddp="none" if self_reducing else "flat", seed=0, bucket_mb=0.002,
                  ckpt_every=2, keep_last=0)
    fields.update(overrides)
    return TrainSettings(**fields)


def step_folder(out, step: int) -> str:
    return f"{out}/ckpt/step-{step:06d}"


def _save_rank(rank, world_size, data, out):
    ctx = DistContext.from_process_group()
    for kind in KINDS:
        Trainer(settings(data, f"{out}/{kind}", kind), ctx).run()
        resumed = Trainer(settings(data, f"{out}/{kind}-again", kind,
                                   resume=step_folder(f"{out}/{kind}", 2)), ctx)
        assert resumed.step == 2
        resumed.run()


def _reload_rank(rank, world_size, data, source, out):
    """Every kind loads the step-2 checkpoint of the kind before it in KINDS (saved at
    another size) and saves it again, without training."""
    ctx = DistContext.from_process_group()
    for i, kind in enumerate(KINDS):
        other = KINDS[i - 1]
        t = Trainer(settings(data, f"{out}/{kind}-from-{other}", kind,
                             resume=step_folder(f"{source}/{other}", 2)), ctx)
        t.save_checkpoint()
        t.checkpointer.finish()


def losses(out) -> dict[int, float]:
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def whole(folder, tmp_path: Path) -> dict:
    """A step folder's export, loaded."""
    target = tmp_path / "exports" / f"{abs(hash(str(folder)))}.pt"
    target.parent.mkdir(exist_ok=True)
    export(folder, target)
    return torch.load(target, weights_only=True)


def same_state(a: dict, b: dict) -> bool:
    """Model, AdamW state, step and data position equal bit for bit."""
    return (a["step"], a["sampler"]) == (b["step"], b["sampler"]) and \
        same_model_and_optimizer(a, b)


def test_every_kind_saves_and_loads_at_every_world_size(world_size, corpus_dir, tmp_path):
    here = tmp_path / f"ws{world_size}"
    run_ranks(_save_rank, world_size, str(corpus_dir), str(here), timeout=300)
    for kind in KINDS:
        straight, again = losses(here / kind), losses(here / f"{kind}-again")
        assert sorted(again) == [3, 4]
        assert all(again[s] == straight[s] for s in again), (kind, straight, again)
        assert same_state(whole(step_folder(here / kind, 4), tmp_path),
                          whole(step_folder(here / f"{kind}-again", 4), tmp_path)), kind
        manifest = json.loads((Path(step_folder(here / kind, 2)) / "manifest.json").read_text())
        # Every rank wrote a file of its own (no rank wrote everything).
        assert sum(n.endswith(".distcp") for n in manifest["files"]) == world_size, kind
    # Another world size, every kind loading another kind's checkpoint.
    other_size, out = world_size % 4 + 1, tmp_path / "other"
    run_ranks(_reload_rank, other_size, str(corpus_dir), str(here), str(out), timeout=300)
    for i, kind in enumerate(KINDS):
        source = step_folder(here / KINDS[i - 1], 2)
        copy = step_folder(out / f"{kind}-from-{KINDS[i - 1]}", 2)
        assert same_state(whole(source, tmp_path), whole(copy, tmp_path)), (other_size, kind)


def _zero3_rank(rank, world_size, out):
    """zero1's stage 3: train 2 steps, save (each rank its shards), then load into a fresh
    stage-3 model; returns the whole state before and after (gathered only to compare)."""
    from torch.distributed.checkpoint import FileSystemReader

    import zero1
    from lab2_trainer.checkpoint.parts import load_into, saved_tensors
    from lab2_trainer.checkpoint.writer import Checkpointer
    from lab2_trainer.models.transformer import TransformerLM
    from lab2_trainer.parallel.parallelize import param_groups

    s = settings("unused", out, "none")

    def build(seed):
        model = TransformerLM(s.model, seed=seed)
        zero1.shard_model(model, units=list(model.blocks))
        return model, zero1.Stage3Optimizer(param_groups(model, s.weight_decay),
                                            torch.optim.AdamW, lr=1e-2)

    def whole_state(model, opt):
        opt.consolidate_state_dict(to=0)
        full = zero1.sharding_of(model).full_state_dict(to=0)
        return (full, opt.state_dict()) if rank == 0 else None

    model, opt = build(0)
    for step in range(2):
        x = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(step))
        model(x, x)[1].backward()
        opt.step()
        opt.zero_grad()
    small = bare_trainer_state(s, opt, 2, world_size)
    writer = Checkpointer(out, model, opt, "zero3", torch.device("cpu"), keep_last=0)
    writer.save(2, small if rank == 0 else None)
    writer.finish()
    before = whole_state(model, opt)
    folder = f"{out}/ckpt/step-000002"
    again, again_opt = build(1)
    load_into(again, again_opt, "zero3", FileSystemReader(folder), set(saved_tensors(folder)))
    return before, whole_state(again, again_opt)


def test_zero3_shards_save_export_and_load_without_a_gather(world_size, tmp_path):
    before, after = run_ranks(_zero3_rank, world_size, str(tmp_path / "z3"), timeout=240)[0]
    manifest = json.loads((tmp_path / "z3/ckpt/step-000002/manifest.json").read_text())
    assert sum(n.endswith(".distcp") for n in manifest["files"]) == world_size
    exported = whole(tmp_path / "z3/ckpt/step-000002", tmp_path)
    for state in (after, (exported["model"], exported["optimizer"])):
        model, opt = state
        assert model.keys() == before[0].keys()
        assert all(torch.equal(model[k], before[0][k]) for k in model)
        assert opt["state"].keys() == before[1]["state"].keys()
        assert all(torch.equal(opt["state"][i][k], before[1]["state"][i][k])
                   for i in opt["state"] for k in opt["state"][i])
