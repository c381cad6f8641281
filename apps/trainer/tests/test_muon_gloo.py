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
* The trainer's loop (float32): stopping and resuming a muon run under zero1, zero2,
  zero3, zero1-allreduce and torch changes nothing, bit for bit; checkpoints move between
  one process and the ranks, and through ``lab2-train export``, continuing the
  one-process run.

One set of ranks per world size runs the steps; the tests read its results.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from lab2_testing.ddp_testkit import bitwise_equal, relative_error
from lab2_testing.dist import run_ranks
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


def build(kind: str) -> TransformerLM:
    return TransformerLM(ModelConfig(**SHAPE, **MODELS[kind]), seed=0).to(torch.float64)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        window = torch.randint(0, SHAPE["vocab_size"], (BATCH, SHAPE["context_length"] + 1),
                               generator=gen)
        out.append((window[:, :-1], window[:, 1:]))
    return out


def set_up(kind: str, sharding: str, ddp: str):
    return parallelize(build(kind), sharding=sharding, ddp=ddp, device=CPU, lr=LR,
                       betas=(0.9, 0.95), weight_decay=0.1, bucket_mb=0.001,
                       muon=MuonSettings(MUON_LR, ns_dtype=None))


def train(parallel, rank: int, world: int, accum: int, clip: float):
    """STEPS steps on this rank's slice of each global batch, the schedule setting both
    learning rates; (losses, norms, whole weights, whole optimizer state on rank 0)."""
    schedule = WarmupCosine(LR, LR / 10, 1, STEPS)
    losses, norms = [], []
    for step, (x, y) in enumerate(batches()):
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
    assert [len(g["params"]) for g in groups] == [1, 7, 10]  # head; norms, tables; matrices
    state = ckpt["optimizer"]["state"]
    assert all(state[i].keys() == {"momentum_buffer"} for i in groups[2]["params"])
    assert all(state[i].keys() == {"exp_avg", "exp_avg_sq", "step"}
               for g in groups[:2] for i in g["params"])
    assert json.loads(json.dumps(ckpt["settings"]))["optimizer"] == "muon"
    again = Trainer(tiny_settings(corpus_dir, tmp_path / "from-export",
                                  resume=str(tmp_path / "zero1.pt")), DistContext())
    again.run()
    assert relative_error(expected, params_of(again)) < 1e-5
