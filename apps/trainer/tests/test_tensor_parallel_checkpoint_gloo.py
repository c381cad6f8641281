"""Checkpoints of tensor-parallel runs, on Gloo ranks: saved at one ``--tp``, loaded at any
other, at another data-parallel size and under another sharding kind.

Float64, at the level of the step (``parallelize`` and ``train_step``, as
``test_tensor_parallel_gloo``), in the cell of world size W (2-4): a run at tp 2 (tp 3 on
3 ranks; on 4 ranks dp 2 x tp 2) of each family (none, zero1, zero2, zero3, fsdp, torch),
with and without sequence parallelism, on two models (SwiGLU; GELU with tied embeddings),
trains 2 steps and saves (each rank its own boxes, nothing gathered). Then:

* the checkpoint's export (one plain file) holds the model and AdamW's state of one
  process trained on the full batch, to float64 rounding, and loads into a tp-1
  ``TransformerLM`` with ``strict=True``, whose logits are every rank's slice of the
  vocabulary-parallel logits;
* fresh ranks load it at tp 1 (dp W), at tp 2 and at tp W, each under another kind, save
  it again at once (its export is bit for bit the source's) and train a third step: its
  loss and the weights after it are one process's, to float64 rounding;
* one load of each checkpoint reads instead its copy in the layout of manifest version 1
  (every tensor its flat view, written in two chunks as two ranks did): the same state.

The trainer's loop (float32): a run at tp 2 with checkpoints resumed at tp 2 continues
with the uninterrupted run's losses bit for bit and saves the same state; resumed at tp 1,
at dp 2 x tp 2 (from dp 1 x tp 2) and at tp 4 it continues to float32 rounding; resumed
from the checkpoint's export (one file) at dp 2 x tp 2 it has the losses of the resume
from the step folder, bit for bit.
"""

from __future__ import annotations

import functools
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from lab2_testing.ddp_testkit import relative_error
from lab2_testing.dist import run_ranks
from lab2_testing.lm import random_windows
from lab2_testing.trainer_state import bare_trainer_state
from lab2_trainer.checkpoint.export import export
from lab2_trainer.config import ModelConfig, TrainSettings
from lab2_trainer.models.transformer import TransformerLM
from lab2_trainer.parallel.mesh import Mesh
from lab2_trainer.parallel.parallelize import parallelize
from lab2_trainer.runtime.launch import DistContext
from lab2_trainer.training.loop import Trainer
from lab2_trainer.training.step import train_step

torch.set_num_threads(1)

# Every size divides by 2, 3 and 4: one model shape serves every tp.
SHAPE = dict(context_length=12, d_model=24, n_layers=2, n_heads=12, d_ff=48, vocab_size=48)
MODELS = {
    "swiglu": dict(norm="tritonnorm"),
    "gelu-tied": dict(norm="layernorm", ffn="gelu", tie_embeddings=True),
}
BATCH, STEPS, SAVED_AT, CLIP, LR = 12, 3, 2, 0.05, 1e-2  # BATCH: dp 1-4 divide it
CPU = torch.device("cpu")
#: (model, sharding, sequence parallel) of the runs that save.
SAVES = [
    ("swiglu", "none", True),
    ("gelu-tied", "zero1", False),
    ("swiglu", "zero2", True),
    ("gelu-tied", "zero3", True),
    ("swiglu", "fsdp", False),
    ("gelu-tied", "torch", True),
]
#: The kinds the loads rotate through.
LOADS = ("zero2", "fsdp", "none", "zero1", "zero3", "torch")


def config(kind: str) -> ModelConfig:
    return ModelConfig(**SHAPE, **MODELS[kind])


def ddp_for(sharding: str, dp: int) -> str:
    """A DDP wrapper where the kind needs one to average over ``dp`` ranks."""
    if sharding == "torch":
        return "torch"
    return "bucketed" if sharding == "none" and dp > 1 else "none"


def save_tp(world_size: int) -> int:
    return 3 if world_size == 3 else 2


def load_tps(world_size: int) -> list[int]:
    return sorted({1, save_tp(world_size), world_size})


def set_up(kind: str, sharding: str, tp: int, sp: bool, seed: int = 0):
    """A float64 model on a dp x tp mesh (every rank data-parallel at tp 1) under
    ``sharding``."""
    model = TransformerLM(config(kind), seed=seed).to(torch.float64)
    mesh = Mesh.data_tensor(tp) if tp > 1 else None
    dp = mesh.size("dp") if mesh is not None else (
        torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1)
    return parallelize(model, sharding=sharding, ddp=ddp_for(sharding, dp), device=CPU,
                       lr=LR, betas=(0.9, 0.95), weight_decay=0.1, bucket_mb=0.001,
                       mesh=mesh, sequence_parallel=sp)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return random_windows(STEPS, BATCH, SHAPE["vocab_size"], SHAPE["context_length"])


def data_rank(parallel) -> tuple[int, int]:
    """(index, count) of this rank's data-parallel slice of each batch."""
    mesh = getattr(parallel, "mesh", None)
    if mesh is not None:
        return mesh.coordinate("dp"), mesh.size("dp")
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def train(parallel, steps: range) -> list[float]:
    """Steps ``steps`` on this data-parallel rank's slice of each global batch; this
    rank's losses."""
    index, dp = data_rank(parallel)
    per = BATCH // dp
    losses = []
    for step in steps:
        x, y = batches()[step]
        x, y = x[index * per:(index + 1) * per], y[index * per:(index + 1) * per]
        loss, _ = train_step(parallel, [(x, y)], precision="fp32", device=CPU, clip=CLIP)
        losses.append(float(loss))
    return losses


def placement(parallel):
    from lab2_trainer.checkpoint.parts import Placement

    return Placement.here(getattr(parallel, "layout", None))


def save(parallel, kind: str, out: str, rank: int) -> None:
    """Every rank its boxes, into ``<out>/ckpt/step-000002``, in the foreground."""
    from lab2_trainer.checkpoint.writer import Checkpointer

    settings = TrainSettings(model=config(kind), weight_decay=0.1)
    small = bare_trainer_state(settings, parallel.optimizer, SAVED_AT)
    writer = Checkpointer(out, parallel.model, parallel.optimizer, parallel.sharding, CPU,
                          asynchronous=False, keep_last=0,
                          layout=getattr(parallel, "layout", None))
    writer.save(SAVED_AT, small if rank == 0 else None)
    writer.finish()
    # The pinned buffers made ahead of the saves (on CUDA) are the boxes a save copies:
    # the model's and the moments' (the counts are made at the save).
    staged = {key: (buf.shape, buf.dtype) for key, buf in writer._buffers.items()
              if not key[0].endswith(".step")}
    assert staged == {key: (shape, dtype) for key, shape, dtype in writer._expected()}


def step_folder(out) -> str:
    return f"{out}/ckpt/step-{SAVED_AT:06d}"


def _save_rank(rank, world_size, out):
    """Each saving run: 2 steps, a save; returns this rank's logits (its slice of the
    vocabulary) of the first batch after the save."""
    tp = save_tp(world_size)
    logits = {}
    for i, (kind, sharding, sp) in enumerate(SAVES):
        parallel = set_up(kind, sharding, tp, sp)
        train(parallel, range(SAVED_AT))
        save(parallel, kind, f"{out}/save{i}", rank)
        with torch.no_grad():
            logits[i] = parallel.eval_module(batches()[0][0])
    return logits


def _load_rank(rank, world_size, out):
    """Each checkpoint loaded at every tp of :func:`load_tps` under another kind, saved
    again, then a third step; returns (this rank's loss of it, the whole model after it
    on rank 0) by (checkpoint, tp)."""
    from torch.distributed.checkpoint import FileSystemReader

    from lab2_trainer.checkpoint.parts import load_into, saved_tensors

    results = {}
    for i, (kind, _, _) in enumerate(SAVES):
        for j, tp in enumerate(load_tps(world_size)):
            sharding = LOADS[(i + j) % len(LOADS)]
            sp = tp > 1 and (i + j) % 2 == 0
            parallel = set_up(kind, sharding, tp, sp, seed=7)  # other weights: all loaded
            # One load of each checkpoint reads its copy of manifest version 1.
            source = step_folder(f"{out}/{'v1-' if j == i % 2 else ''}save{i}")
            load_into(parallel.model, parallel.optimizer, sharding, FileSystemReader(source),
                      set(saved_tensors(source)), placement(parallel))
            save(parallel, kind, f"{out}/load{i}-tp{tp}", rank)
            losses = train(parallel, range(SAVED_AT, STEPS))
            state = parallel.full_model_state(rank)
            results[(i, tp)] = (losses[0], state, sharding, sp)
    return results


def version_1_copy(folder: Path, target: Path) -> None:
    """``folder``'s checkpoint in the layout of manifest version 1: each tensor its flat
    view, in two chunks (as two ranks wrote them), with its manifest."""
    from torch.distributed.checkpoint import FileSystemWriter

    from lab2_trainer.checkpoint.folders import TRAINER_STATE, file_crc
    from lab2_trainer.checkpoint.parts import Part, full_tensors, saved_tensors, write_parts

    whole = full_tensors(folder, sorted(saved_tensors(folder)))
    parts = []
    for key, t in whole.items():
        flat = t.reshape(-1)
        half = flat.numel() // 2
        for lo, hi in ((0, half), (half, flat.numel())):
            if hi > lo:
                parts.append(Part(key, (flat.numel(),), (lo,), flat[lo:hi].clone()))
    target.mkdir(parents=True)
    write_parts(parts, FileSystemWriter(str(target)))
    shutil.copy(folder / TRAINER_STATE, target / TRAINER_STATE)
    files = {n.name: file_crc(n) for n in target.iterdir()}
    body = {"format": "lab2-trainer-sharded-checkpoint", "version": 1, "step": SAVED_AT,
            "files": {n: {"bytes": b, "crc32": f"{c:08x}"} for n, (b, c) in sorted(files.items())}}
    (target / "manifest.json").write_text(json.dumps(body))


@functools.cache
def reference(kind: str) -> dict:
    """One process on the full batch: the model and AdamW's state after 2 steps, the
    third step's loss and the model after it."""
    parallel = set_up(kind, "none", 1, False)
    train(parallel, range(SAVED_AT))
    opt = parallel.optimizer.state_dict()
    at_save = {"model": {k: v.clone() for k, v in parallel.model.state_dict().items()},
               "optimizer": {i: {k: v.clone() for k, v in s.items()}
                             for i, s in opt["state"].items()}}
    loss = train(parallel, range(SAVED_AT, STEPS))[0]
    return {"saved": at_save, "loss": loss,
            "after": {k: v.clone() for k, v in parallel.model.state_dict().items()}}


def exported(folder, tmp_path: Path) -> dict:
    target = tmp_path / "exports" / f"{abs(hash(str(folder)))}.pt"
    target.parent.mkdir(exist_ok=True)
    export(folder, target)
    return torch.load(target, weights_only=True)


def moments(state: dict) -> dict[str, torch.Tensor]:
    """AdamW's state as one flat dict (``<number>.<name>``), ``step`` as a tensor."""
    return {f"{i}.{k}": torch.as_tensor(v, dtype=torch.float64) for i, s in state.items()
            for k, v in s.items()}


def test_tp_checkpoints_load_at_every_tp_and_kind(world_size, tmp_path):
    if world_size == 1:
        pytest.skip("tensor parallelism needs at least 2 ranks")
    out = tmp_path / f"ws{world_size}"
    logits = run_ranks(_save_rank, world_size, str(out), timeout=420)
    tp = save_tp(world_size)
    for i, (kind, sharding, _) in enumerate(SAVES):
        whole = exported(step_folder(out / f"save{i}"), tmp_path)
        ref = reference(kind)["saved"]
        assert whole["model"].keys() == ref["model"].keys(), sharding
        assert relative_error(ref["model"], whole["model"]) < 1e-12, sharding
        ours, theirs = moments(whole["optimizer"]["state"]), moments(ref["optimizer"])
        assert ours.keys() == theirs.keys(), sharding
        assert relative_error(theirs, ours) < 1e-12, sharding
        # A tp-1 model takes the export as it is, and computes every rank's slice.
        model = TransformerLM(config(kind)).to(torch.float64)
        model.load_state_dict(whole["model"], strict=True)
        with torch.no_grad():
            full = model(batches()[0][0])
        vocab = SHAPE["vocab_size"] // tp
        for rank in range(world_size):
            part = full[..., (rank % tp) * vocab:(rank % tp + 1) * vocab]
            got = logits[rank][i]
            assert float((got - part).norm() / part.norm()) < 1e-12, (sharding, rank)
        version_1_copy(Path(step_folder(out / f"save{i}")), Path(step_folder(out / f"v1-save{i}")))
    loaded = run_ranks(_load_rank, world_size, str(out), timeout=420)
    for (i, load_tp), (_, state, sharding, sp) in loaded[0].items():
        kind = SAVES[i][0]
        source = exported(step_folder(out / f"save{i}"), tmp_path)
        again = exported(step_folder(out / f"load{i}-tp{load_tp}"), tmp_path)
        where = (SAVES[i], load_tp, sharding, sp)
        for part in ("model",):
            assert all(torch.equal(source[part][k], again[part][k]) for k in source[part]), where
        a, b = moments(source["optimizer"]["state"]), moments(again["optimizer"]["state"])
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), where
        ref = reference(kind)
        # The step's loss: the mean of every rank's (float32 sums inside the step).
        loss = sum(r[(i, load_tp)][0] for r in loaded) / world_size
        assert abs(loss - ref["loss"]) < 1e-6 * abs(ref["loss"]), where
        assert relative_error(ref["after"], state) < 1e-12, where


# ------------------------------------------------------------------------ the loop
def trainer_settings(data, out, **overrides) -> TrainSettings:
    model = ModelConfig(context_length=16, d_model=32, n_layers=2, n_heads=4, d_ff=64,
                        norm="tritonnorm")
    fields = dict(model=model, data=str(data), steps=4, batch_size=8, lr=1e-2, min_lr=1e-3,
                  warmup=2, eval_every=0, eval_batches=1, out=str(out), sample_tokens=0,
                  quiet=True, plot=False, ddp="none", sharding="none", seed=0, clip=0.05,
                  bucket_mb=0.002, ckpt_every=2, keep_last=0, ckpt_async=False)
    fields.update(overrides)
    return TrainSettings(**fields)


def run_trainer(ctx, world_size, data, out, **overrides) -> Trainer:
    trainer = Trainer(trainer_settings(data, out, **overrides).validate(world_size), ctx)
    trainer.run()
    return trainer


def _loop_rank(rank, world_size, data, out, runs):
    ctx = DistContext.from_process_group()
    for name, overrides in runs:
        run_trainer(ctx, world_size, data, f"{out}/{name}", **overrides)


def losses(out) -> dict[int, float]:
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def test_a_tp_run_resumes_exactly_at_its_tp_and_closely_at_another(world_size, corpus_dir,
                                                                   tmp_path):
    if world_size != 2:
        pytest.skip("one cell: tp 2 on 2 ranks, resumed on 2 and on 4 ranks")
    out = tmp_path / "loop"
    step2 = lambda name: str(out / name / "ckpt" / "step-000002")  # noqa: E731
    run_ranks(_loop_rank, 2, str(corpus_dir), str(out), [
        ("tp2", dict(tp=2, sequence_parallel=True)),
        ("tp2-again", dict(tp=2, sequence_parallel=True, resume=step2("tp2"))),
        ("tp1", dict(sharding="zero1", resume=step2("tp2"))),
    ], timeout=420)
    single = tmp_path / "tp2-step2.pt"  # the export, one plain file: --resume takes it too
    export(step2("tp2"), single)
    run_ranks(_loop_rank, 4, str(corpus_dir), str(out), [
        ("dp2-tp2", dict(tp=2, sharding="zero2", resume=step2("tp2"))),
        ("dp2-tp2-file", dict(tp=2, sharding="zero2", resume=str(single))),
        ("tp4", dict(tp=4, sharding="fsdp", sequence_parallel=True, resume=step2("tp2"))),
    ], timeout=420)
    # The step folder and its export resume alike: the same losses, bit for bit.
    assert losses(out / "dp2-tp2-file") == losses(out / "dp2-tp2")
    straight = losses(out / "tp2")
    again = losses(out / "tp2-again")
    assert sorted(again) == [3, 4]
    assert all(again[s] == straight[s] for s in again), (straight, again)
    a = exported(out / "tp2" / "ckpt" / "step-000004", tmp_path)
    b = exported(out / "tp2-again" / "ckpt" / "step-000004", tmp_path)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    ma, mb = moments(a["optimizer"]["state"]), moments(b["optimizer"]["state"])
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    assert a["sampler"] == b["sampler"]
    for name in ("tp1", "dp2-tp2", "tp4"):
        other = losses(out / name)
        assert sorted(other) == [3, 4], name
        assert all(math.isclose(other[s], straight[s], rel_tol=1e-4) for s in other), (
            name, straight, other)
        manifest = json.loads((out / name / "ckpt" / "step-000004" / "manifest.json")
                              .read_text())
        assert manifest["version"] == 2 and manifest["tp"] == {"tp1": 1, "dp2-tp2": 2,
                                                               "tp4": 4}[name]
