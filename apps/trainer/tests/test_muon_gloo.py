"""``--optimizer muon`` on Gloo ranks: zero1.Muon over the blocks' matrices, AdamW over the
rest, under every sharding family that runs it.

* Whole training steps in float64 (``train_step`` on a float64 model, the Newton-Schulz
  iteration in float64 too) under zero1's stages 1, 2 and 3, its broadcasting kind,
  PyTorch's ZeroRedundancyOptimizer and the minddp wrappers with plain Muon, with and
  without clipping and gradient accumulation, on two models (SwiGLU with tritonnorm; GELU
  with LayerNorm and tied embeddings, whose AdamW keeps no matrix): losses, gradient
  norms, the final weights and the whole optimizer state (Muon's momentum buffers and
  AdamW's moments, consolidated) equal one process's on the full batch to float64
  rounding, with the schedule setting both learning rates every step.
* A zero1 checkpoint of 2-4 ranks (each matrix's momentum written whole by its owner rank)
  loads on one process bit for bit, which then continues exactly as one given the ranks'
  state in memory, and as the uninterrupted run to float64 rounding.
* The trainer's loop (float32): stopping and resuming a muon run under zero1, zero2,
  zero3, zero1-allreduce and torch changes nothing, bit for bit; checkpoints move between
  one process and the ranks, and through ``lab2-train export``, continuing the
  one-process run.

One set of ranks per world size runs the steps; the tests read its results.
"""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch

from lab2_testing.ddp_testkit import bitwise_equal, relative_error
from lab2_testing.dist import run_ranks
from lab2_testing.lm import random_windows
from lab2_testing.trainer_state import bare_trainer_state
from lab2_trainer.checkpoint.export import export
from lab2_trainer.config import ModelConfig, TrainSettings
from lab2_trainer.models.transformer import TransformerLM
from lab2_trainer.parallel.optimizers import MuonSettings
from lab2_trainer.parallel.parallelize import parallelize
from lab2_trainer.recipe.schedule import WarmupCosine
from lab2_trainer.runtime.launch import DistContext
from lab2_trainer.training.loop import Trainer
from lab2_trainer.training.step import set_lr, train_step

torch.set_num_threads(1)

SHAPE = dict(context_length=12, d_model=24, n_layers=2, n_heads=4, d_ff=48, vocab_size=48)
MODELS = {
    "swiglu": dict(norm="tritonnorm"),
    "gelu-tied": dict(norm="layernorm", ffn="gelu", tie_embeddings=True),
}
# 24 sequences: split evenly over 1-4 ranks x 1-2 micro-batches.
BATCH, STEPS, CLIP, LR, MUON_LR = 24, 3, 0.05, 1e-2, 0.05
CPU = torch.device("cpu")
#: Muon's matrices per model: the blocks' qkv, proj and the feed-forward's matrices.
MATRICES = {"swiglu": 2 * 5, "gelu-tied": 2 * 4}

# (model, sharding, ddp, grad_accum, clip)
VARIANTS = [
    ("swiglu", "zero1", "none", 1, CLIP),
    ("swiglu", "zero2", "none", 2, CLIP),
    ("swiglu", "zero3", "none", 1, CLIP),
    ("gelu-tied", "zero3", "none", 2, 0.0),
    ("gelu-tied", "zero2", "none", 1, CLIP),
    ("swiglu", "none", "bucketed", 2, CLIP),
    ("swiglu", "zero1-allreduce", "individual", 1, CLIP),
    ("gelu-tied", "torch", "torch", 1, CLIP),
]


def build(kind: str, seed: int = 0) -> TransformerLM:
    return TransformerLM(ModelConfig(**SHAPE, **MODELS[kind]), seed=seed).to(torch.float64)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return random_windows(STEPS, BATCH, SHAPE["vocab_size"], SHAPE["context_length"])


def set_up(kind: str, sharding: str, ddp: str, seed: int = 0):
    return parallelize(build(kind, seed), sharding=sharding, ddp=ddp, device=CPU, lr=LR,
                       betas=(0.9, 0.95), weight_decay=0.1, bucket_mb=0.001,
                       muon=MuonSettings(MUON_LR, ns_dtype=None))


def train(parallel, rank: int, world: int, accum: int, clip: float, steps=range(STEPS)):
    """``steps`` (all STEPS by default) on this rank's slice of each global batch, the
    schedule setting both learning rates; (losses, norms, whole weights, whole optimizer
    state on rank 0)."""
    schedule = WarmupCosine(LR, LR / 10, 1, STEPS)
    losses, norms = [], []
    for step in steps:
        x, y = batches()[step]
        per = BATCH // world
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        micro = per // accum
        parts = [(x[i * micro:(i + 1) * micro], y[i * micro:(i + 1) * micro])
                 for i in range(accum)]
        set_lr(parallel.optimizer, schedule(step))
        loss, norm = train_step(parallel, parts, precision="fp32", device=CPU, clip=clip)
        losses.append(float(loss))
        norms.append(float(norm))
    return (losses, norms, parallel.full_model_state(rank),
            parallel.full_optimizer_state(rank))


def _rank(rank, world_size):
    return {variant: train(set_up(*variant[:3]), rank, world_size, *variant[3:])
            for variant in VARIANTS}


@functools.cache
def spawned(world_size: int) -> list[dict]:
    return run_ranks(_rank, world_size, timeout=420)


@functools.cache
def reference(kind: str, clip: float):
    """One process on the full batch."""
    return train(set_up(kind, "none", "none"), 0, 1, 1, clip)


def state_error(ref: dict, got: dict) -> float:
    """The largest norm-relative error over every state tensor of two optimizer state
    dicts of one layout (their groups' hyperparameters equal)."""
    assert [{k: v for k, v in g.items() if k != "params"} for g in ref["param_groups"]] == \
        [{k: v for k, v in g.items() if k != "params"} for g in got["param_groups"]]
    assert ref["state"].keys() == got["state"].keys()
    worst = 0.0
    for i, entry in ref["state"].items():
        assert entry.keys() == got["state"][i].keys(), i
        for key, value in entry.items():
            other = got["state"][i][key]
            worst = max(worst, float((value.double() - other.double()).norm()
                                     / value.double().norm().clamp(min=1e-300)))
    return worst


def test_muon_steps_match_one_process_on_the_full_batch(world_size):
    per_rank = spawned(world_size)
    for variant in VARIANTS:
        kind, _, _, _, clip = variant
        ref_losses, ref_norms, ref_state, ref_optim = reference(kind, clip)
        _, norms, state, optim = per_rank[0][variant]
        # The loop's loss: the mean of every rank's (float32 sums inside the step).
        losses = [sum(r[variant][0][i] for r in per_rank) / world_size for i in range(STEPS)]
        for ours, ref in zip(losses, ref_losses):
            assert abs(ours - ref) < 1e-6 * abs(ref), (variant, losses, ref_losses)
        for ours, ref in zip(norms, ref_norms):
            assert abs(ours - ref) < 1e-12 * ref, (variant, norms, ref_norms)
        for other in per_rank[1:]:  # every rank measured the same norm
            assert other[variant][1] == norms, variant
        if clip:
            assert min(ref_norms) > 2 * clip  # every step clipped
        assert relative_error(ref_state, state) < 1e-11, variant
        assert state_error(ref_optim, optim) < 1e-10, variant
        # The layout: AdamW's two groups, then Muon's one, over the blocks' matrices.
        groups = optim["param_groups"]
        assert len(groups) == 3 and "momentum" in groups[2] and "betas" in groups[0]
        muon = [optim["state"][i] for i in groups[2]["params"]]
        assert len(muon) == MATRICES[kind]
        assert all(entry.keys() == {"momentum_buffer"} for entry in muon)
        assert groups[2]["lr"] == pytest.approx(groups[0]["lr"] * MUON_LR / LR)


# ---------------------------------------- a zero1 checkpoint of the ranks on one process
SAVED_AT = 2  # steps before the save; the rest of STEPS after it


def save_folder(parallel, out: str, rank: int) -> str:
    """Every rank its boxes of the model and of both optimizers' state, in the
    foreground, as step SAVED_AT of a run in ``out``; returns the step folder."""
    from lab2_trainer.checkpoint.writer import Checkpointer

    settings = TrainSettings(model=ModelConfig(**SHAPE, **MODELS["swiglu"]), lr=LR,
                             weight_decay=0.1, optimizer="muon", muon_lr=MUON_LR)
    small = bare_trainer_state(settings, parallel.optimizer, SAVED_AT)
    writer = Checkpointer(out, parallel.model, parallel.optimizer, parallel.sharding, CPU,
                          asynchronous=False, keep_last=0)
    writer.save(SAVED_AT, small if rank == 0 else None)
    writer.finish()
    # What the writer expects to copy (the buffers made ahead on CUDA), each optimizer's
    # state names included, is what the save copied (AdamW's counts are made at the save).
    staged = {key: (buf.shape, buf.dtype) for key, buf in writer._buffers.items()
              if not key[0].endswith(".step")}
    assert staged == {key: (shape, dtype) for key, shape, dtype in writer._expected()}
    return f"{out}/ckpt/step-{SAVED_AT:06d}"


def state_tensors(optim: dict) -> dict[str, torch.Tensor]:
    """An optimizer state dict's tensors, keyed ``<parameter number>.<state name>``."""
    return {f"{i}.{what}": t for i, entry in optim["state"].items() for what, t in entry.items()}


def _zero1_save_rank(rank, world_size, out):
    """zero1 on the ranks: SAVED_AT steps, a checkpoint, the rest. Returns the ranges of
    Muon's state this rank saved ((key, start, elements, the parameter's elements)), and
    on rank 0 the whole model and optimizer state at the save and at the end."""
    from lab2_trainer.checkpoint.parts import MUON_STATE, state_holders, state_parts

    parallel = set_up("swiglu", "zero1", "none")
    train(parallel, rank, world_size, 1, CLIP, range(SAVED_AT))
    holders = [h for h in state_holders(parallel.model, parallel.optimizer, "zero1")
               if h.tensors == MUON_STATE]
    sizes = {name: p.numel() for name, p in parallel.model.named_parameters()}
    muon = [(r.key, r.start, r.data.numel(), sizes[r.key.split(".", 1)[1].rsplit(".", 1)[0]])
            for r in state_parts(holders)]
    save_folder(parallel, out, rank)
    # Copies: the live tensors step on.
    saved = copy.deepcopy((parallel.full_model_state(rank), parallel.full_optimizer_state(rank)))
    *_, model, optim = train(parallel, rank, world_size, 1, CLIP, range(SAVED_AT, STEPS))
    return muon, saved, (model, optim)


def test_a_zero1_checkpoint_of_the_ranks_continues_on_one_process(world_size, tmp_path):
    if world_size == 1:
        pytest.skip("a checkpoint of several ranks")
    from torch.distributed.checkpoint import FileSystemReader

    from lab2_trainer.checkpoint.parts import load_into, saved_tensors

    out = tmp_path / "zero1"
    per_rank = run_ranks(_zero1_save_rank, world_size, str(out), timeout=300)
    # Muon's state: each matrix's momentum whole on one rank (its owner), every rank one.
    kept = [key for muon, *_ in per_rank for key, *_ in muon]
    assert len(kept) == len(set(kept)) == MATRICES["swiglu"]
    assert all(key.endswith(".momentum_buffer") for key in kept)
    for muon, *_ in per_rank:
        assert muon and all(start == 0 and n == whole for _, start, n, whole in muon)
    _, (model_at_save, optim_at_save), (model_end, optim_end) = per_rank[0]
    folder = str(out / "ckpt" / f"step-{SAVED_AT:06d}")
    # One process, other weights to start from: everything it steps with is loaded.
    one = set_up("swiglu", "none", "none", seed=7)
    load_into(one.model, one.optimizer, "none", FileSystemReader(folder),
              set(saved_tensors(folder)))
    # (The groups' rates are the schedule's, set before each step: not a checkpoint's.)
    assert bitwise_equal(model_at_save, one.full_model_state(0))
    assert bitwise_equal(state_tensors(optim_at_save), state_tensors(one.full_optimizer_state(0)))
    # ... and one given the ranks' state in memory: the same steps, bit for bit.
    given = set_up("swiglu", "none", "none", seed=7)
    given.model.load_state_dict(model_at_save)
    given.load_full_optimizer_state(optim_at_save)
    *_, model, optim = train(one, 0, 1, 1, CLIP, range(SAVED_AT, STEPS))
    *_, model_given, optim_given = train(given, 0, 1, 1, CLIP, range(SAVED_AT, STEPS))
    assert bitwise_equal(model_given, model)
    assert bitwise_equal(state_tensors(optim_given), state_tensors(optim))
    # The uninterrupted runs, on the ranks and on one process: float64 rounding apart.
    _, _, ref_model, ref_optim = reference("swiglu", CLIP)
    for whole_model, whole_optim in ((model_end, optim_end), (ref_model, ref_optim)):
        assert relative_error(whole_model, model) < 1e-11
        assert state_error(whole_optim, optim) < 1e-10


# ------------------------------------------------------------------- the trainer's loop
def tiny_settings(data, out, **overrides) -> TrainSettings:
    model = ModelConfig(context_length=16, d_model=32, n_layers=2, n_heads=2, d_ff=64,
                        norm="torch")
    fields = dict(model=model, data=str(data), steps=6, batch_size=24, lr=1e-2, min_lr=1e-3,
                  warmup=2, eval_every=0, eval_batches=1, out=str(out), sample_tokens=0,
                  quiet=True, plot=False, ddp="none", sharding="none", seed=0,
                  bucket_mb=0.002, optimizer="muon", muon_lr=0.05, clip=0.5)
    fields.update(overrides)
    return TrainSettings(**fields)


def params_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    state = trainer.parallel.full_model_state(trainer.ctx.rank)  # a collective with zero3
    return {k: v.detach().cpu().clone() for k, v in (state or {}).items()}


#: (sharding, ddp) of the runs stopped and resumed: where each keeps Muon's state differs.
#: ZeroRedundancyOptimizer under minddp's wrapper: PyTorch's DDP keeps no learned bucket
#: order in the checkpoint, so a resumed run's first step sums in other buckets, which on 3
#: or more ranks rounds otherwise (AdamW's runs too: 1.5e-8 apart at 3 ranks).
KINDS = [("zero1", "none"), ("zero2", "none"), ("zero3", "none"),
         ("zero1-allreduce", "bucketed"), ("torch", "bucketed")]


def _resume_rank(rank, world_size, data, out, single_ckpt):
    ctx = DistContext.from_process_group()
    got = {}
    for kind, ddp in KINDS:
        layout = dict(sharding=kind, ddp=ddp)
        straight = Trainer(tiny_settings(data, f"{out}/{kind}-straight", **layout), ctx)
        straight.run()
        Trainer(tiny_settings(data, f"{out}/{kind}-stopped", **layout), ctx).run(stop_at=3)
        resumed = Trainer(tiny_settings(data, f"{out}/{kind}-resumed", **layout,
                                        resume=f"{out}/{kind}-stopped"), ctx)
        assert resumed.step == 3
        resumed.run()
        got[kind] = (params_of(straight), params_of(resumed))
    # One process's step-3 checkpoint, resumed here by zero2.
    t = Trainer(tiny_settings(data, f"{out}/zero2-from-single", sharding="zero2",
                              resume=single_ckpt), ctx)
    t.run()
    got["zero2-from-single"] = params_of(t)
    return got


def test_muon_checkpoints_resume_exactly_and_across_world_sizes(world_size, corpus_dir,
                                                                tmp_path):
    single = Trainer(tiny_settings(corpus_dir, tmp_path / "single"), DistContext())
    single.run()
    expected = params_of(single)
    Trainer(tiny_settings(corpus_dir, tmp_path / "single-stop"), DistContext()).run(stop_at=3)
    ranks = tmp_path / "ranks"
    got = run_ranks(_resume_rank, world_size, str(corpus_dir), str(ranks),
                    str(tmp_path / "single-stop"), timeout=420)[0]
    # Same world size: stopping and resuming changes nothing, bit for bit.
    for kind, _ in KINDS:
        straight, resumed = got[kind]
        assert bitwise_equal(straight, resumed), kind
        assert relative_error(expected, straight) < 1e-5, kind
    assert relative_error(expected, got["zero2-from-single"]) < 1e-5
    # world_size ranks' zero3 checkpoint (each matrix's momentum on its owner) -> one process.
    back = Trainer(tiny_settings(corpus_dir, tmp_path / "back",
                                 resume=str(ranks / "zero3-stopped")), DistContext())
    assert back.step == 3
    back.run()
    assert relative_error(expected, params_of(back)) < 1e-5
    # The export: one plain state dict, AdamW's groups then Muon's, each its own state.
    export(ranks / "zero1-stopped", tmp_path / "zero1.pt")
    ckpt = torch.load(tmp_path / "zero1.pt", weights_only=True)
    groups = ckpt["optimizer"]["param_groups"]
    # head; norms and the token table (no position table under rope); matrices
    assert [len(g["params"]) for g in groups] == [1, 6, 10]
    state = ckpt["optimizer"]["state"]
    assert all(state[i].keys() == {"momentum_buffer"} for i in groups[2]["params"])
    assert all(state[i].keys() == {"exp_avg", "exp_avg_sq", "step"}
               for g in groups[:2] for i in g["params"])
    assert json.loads(json.dumps(ckpt["settings"]))["optimizer"] == "muon"
    again = Trainer(tiny_settings(corpus_dir, tmp_path / "from-export",
                                  resume=str(tmp_path / "zero1.pt")), DistContext())
    again.run()
    assert relative_error(expected, params_of(again)) < 1e-5
