"""``--compile`` and ``--dropout`` under tensor parallelism, on Gloo ranks (tp 2; dp 2 x tp
2 at four ranks for the seeds).

* Compiled (regional, AOTAutograd's ``aot_eager``: the traced graphs run op by op), with
  and without sequence parallelism and with selective checkpointing: three whole training
  steps in float64 equal the eager ones and one process's on the full batch, in three
  graphs (the embedding, one for every block, the head): no graph break anywhere.
* Dropout without sequence parallelism: every rank of the group draws one process's masks
  (the residual stream is whole on each), so the steps equal one process's with the same
  seed, eager, compiled and under full checkpointing; the whole parameters stay bitwise
  equal over the group.
* Dropout under sequence parallelism, eager: each rank draws masks of its own for its
  slice (they differ between the ranks), the same again from the same seed and under full
  checkpointing (the recomputed forward forks the same streams). Compiled, each rank keeps
  its part of the mask of the whole stream: one process's steps again.
* Dropout at rate 0 leaves everything as it was (the float64 steps above; nothing is
  drawn from the default generators), and the loop
  with ``--tp 2 --sequence-parallel --dropout --compile`` (aot_eager) follows one process's
  loop; the default generators agree over each tensor-parallel group and differ between
  data-parallel ranks.
* ``@slow``: inductor itself, tp 2 with sequence parallelism, gives eager's losses.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lab2_testing.ddp_testkit import relative_error
from lab2_testing.dist import run_ranks, runs_per_world_size
from lab2_testing.lm import random_windows
from lab2_trainer.config import ModelConfig, TrainSettings
from lab2_trainer.models.transformer import TransformerLM
from lab2_trainer.parallel.mesh import Mesh
from lab2_trainer.parallel.parallelize import parallelize
from lab2_trainer.runtime.launch import DistContext
from lab2_trainer.training.loop import Trainer
from lab2_trainer.training.step import train_step

torch.set_num_threads(1)

SHAPE = dict(context_length=12, d_model=24, n_layers=2, n_heads=12, d_ff=48, vocab_size=48)
BATCH, STEPS, CLIP, LR, SEED, RATE = 4, 3, 0.05, 1e-2, 5, 0.1
CPU = torch.device("cpu")
AOT = "aot_eager"

# (sequence parallel, compile backend or None, dropout, activation checkpointing).
CASES = [
    (False, AOT, 0.0, "none"),
    (True, AOT, 0.0, "selective"),
    (False, None, RATE, "none"),
    (False, None, RATE, "full"),
    (False, AOT, RATE, "none"),
    (True, None, RATE, "none"),
    (True, None, RATE, "full"),
    (True, AOT, RATE, "full"),
]
#: The cases that equal one process on the full batch (all but eager dropout under
#: sequence parallelism, whose ranks draw masks of their own).
ONE_PROCESS = [c for c in CASES if not (c[0] and c[1] is None and c[2])]


def build(dropout: float) -> TransformerLM:
    config = ModelConfig(**SHAPE, norm="tritonnorm", dropout=dropout)
    return TransformerLM(config, seed=0).to(torch.float64)


def set_up(mesh: Mesh | None, sp: bool, backend: str | None, dropout: float,
           checkpointing: str):
    model = build(dropout)
    model.activation_checkpointing = checkpointing
    spec = {"backend": backend, "mode": None, "scope": "blocks"} if backend else None
    return parallelize(model, sharding="none", ddp="none", device=CPU, lr=LR,
                       betas=(0.9, 0.95), weight_decay=0.1, bucket_mb=0.001, mesh=mesh,
                       sequence_parallel=sp, compile=spec)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return random_windows(STEPS, BATCH, SHAPE["vocab_size"], SHAPE["context_length"])


def train(parallel) -> list[float]:
    """STEPS steps on the full batch, from the default generators seeded with SEED."""
    torch.manual_seed(SEED)
    losses = []
    for x, y in batches():
        loss, _ = train_step(parallel, [(x, y)], precision="fp32", device=CPU, clip=CLIP)
        losses.append(float(loss))
    return losses


def record_masks(model: TransformerLM) -> list[torch.Tensor]:
    """Record which elements each residual dropout of ``model`` keeps (eager)."""
    kept: list[torch.Tensor] = []

    def spy(drop):
        def recorded(x, p, training):
            out = drop(x, p, training)
            kept.append(((out != 0) | (x == 0)).detach().clone())
            return out
        return recorded

    model.residual_dropout = spy(model.residual_dropout)
    for block in model.blocks:
        block.residual_dropout = spy(block.residual_dropout)
    return kept


def rng_digest() -> str:
    return hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()


def trainer_settings(data, out, **overrides) -> TrainSettings:
    model = ModelConfig(context_length=16, d_model=32, n_layers=2, n_heads=4, d_ff=64,
                        norm="tritonnorm", dropout=RATE)
    fields = dict(model=model, data=str(data), steps=3, batch_size=4, lr=1e-2, min_lr=1e-3,
                  warmup=1, eval_every=0, eval_batches=1, out=str(out), sample_tokens=0,
                  quiet=True, plot=False, ddp="none", sharding="none", seed=3, clip=0.05)
    fields.update(overrides)
    return TrainSettings(**fields)


def _rank(rank, world_size, data, out):
    from torch._dynamo.utils import counters

    ctx = DistContext.from_process_group()
    results: dict = {"steps": {}, "replicated": {}, "graphs": {}, "masks": {}, "drew": {}}
    torch.manual_seed(SEED)
    seeded = rng_digest()
    if world_size == 2:
        mesh = Mesh.data_tensor(2)
        for case in CASES:
            torch._dynamo.reset()
            counters.clear()
            parallel = set_up(mesh, *case)
            masks = record_masks(parallel.model) if case[1] is None and case[2] else None
            losses = train(parallel)
            results["steps"][case] = (losses, parallel.full_model_state(rank))
            results["drew"][case] = rng_digest() != seeded  # anything drawn since the seed
            results["replicated"][case] = {
                n: p.detach().clone() for n, p in parallel.model.named_parameters()
                if not parallel.layout.is_sharded(n)}
            if case[1] is not None:
                results["graphs"][case] = (counters["stats"]["unique_graphs"],
                                           sum(counters["graph_break"].values()))
            if masks:
                results["masks"][case] = masks[:2 * SHAPE["n_layers"] + 1]  # first step
        # Eager dropout under sequence parallelism again from the same seed.
        again = set_up(mesh, True, None, RATE, "none")
        results["again"] = (train(again), again.full_model_state(rank))
        # The loop: compiled, sequence parallel, dropout.
        trainer = Trainer(trainer_settings(
            data, f"{out}/loop", tp=2, sequence_parallel=True, compile=True,
            compile_backend=AOT).validate(world_size), ctx)
        trainer.run()
        results["loop"] = trainer.parallel.full_model_state(rank)
    # The seeds: the same over a tensor-parallel group, different over data-parallel ranks.
    tp = 2 if world_size == 4 else 1
    Trainer(trainer_settings(data, f"{out}/seeds", tp=tp, steps=1,
                             sharding="zero1" if world_size // tp > 1 else "none")
            .validate(world_size), ctx)
    every: list = [None] * world_size
    dist.all_gather_object(every, rng_digest())
    results["digests"] = every
    return results


@pytest.fixture(scope="module")
def spawned(corpus_dir, tmp_path_factory):
    return runs_per_world_size(_rank, str(corpus_dir),
                               root=tmp_path_factory.mktemp("tpcd"), timeout=600)


@functools.cache
def reference(dropout: float) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process on the full batch, eager."""
    parallel = set_up(None, False, None, dropout, "none")
    losses = train(parallel)
    return losses, {k: v.clone() for k, v in parallel.model.state_dict().items()}


def _need(world_size: int, *sizes: int) -> None:
    if world_size not in sizes:
        pytest.skip(f"runs at {' and '.join(map(str, sizes))} ranks")


def test_compiled_and_dropout_steps_equal_one_process(world_size, spawned):
    _need(world_size, 2)
    per_rank = spawned(world_size)
    for case in ONE_PROCESS:
        ref_losses, ref_state = reference(case[2])
        losses, state = per_rank[0]["steps"][case]
        assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(losses, ref_losses)), \
            (case, losses, ref_losses)
        assert relative_error(ref_state, state) < 1e-12, case
    # Rate 0 draws nothing: the compiled runs without dropout are the plain model's.
    assert reference(0.0)[0] != reference(RATE)[0]
    for rank_results in per_rank:
        assert rank_results["drew"] == {case: bool(case[2]) for case in CASES}


def test_no_graph_break_anywhere(world_size, spawned):
    _need(world_size, 2)
    for rank_results in spawned(world_size):
        for case, (graphs, breaks) in rank_results["graphs"].items():
            assert (graphs, breaks) == (3, 0), case


def test_whole_parameters_stay_equal_over_the_group(world_size, spawned):
    _need(world_size, 2)
    first, second = spawned(world_size)
    for case, params in first["replicated"].items():
        other = second["replicated"][case]
        assert params.keys() == other.keys()
        assert all(torch.equal(params[n], other[n]) for n in params), case


def test_sequence_parallel_dropout_draws_each_ranks_own_masks(world_size, spawned):
    _need(world_size, 2)
    first, second = spawned(world_size)
    eager = (True, None, RATE, "none")
    mine, theirs = first["masks"][eager], second["masks"][eager]
    assert len(mine) == len(theirs) == 2 * SHAPE["n_layers"] + 1
    for a, b in zip(mine, theirs):
        assert a.shape == b.shape == (BATCH, SHAPE["context_length"] // 2, SHAPE["d_model"])
        assert not torch.equal(a, b)
        assert 0.8 < a.double().mean() < 0.97  # about 1 - RATE kept
    # Without sequence parallelism the ranks drop the same elements.
    same = (False, None, RATE, "none")
    assert all(torch.equal(a, b) for a, b in zip(first["masks"][same], second["masks"][same]))
    # Reproducible from the seed, and recomputed alike under full checkpointing.
    losses, state = first["steps"][eager]
    again_losses, again_state = first["again"]
    assert losses == again_losses
    assert all(torch.equal(state[k], again_state[k]) for k in state)
    ckpt_losses, ckpt_state = first["steps"][(True, None, RATE, "full")]
    assert ckpt_losses == losses
    assert relative_error(state, ckpt_state) < 1e-14
    # They are not one process's masks (that one draws the whole stream's).
    assert relative_error(reference(RATE)[1], state) > 1e-6


def test_the_compiled_dropout_loop_follows_one_process(world_size, spawned, corpus_dir):
    _need(world_size, 2)
    root = Path(spawned.root)
    ref = Trainer(trainer_settings(corpus_dir, root / "ref", compile=True,
                                   compile_backend=AOT), DistContext())
    ref.run()
    expected = {k: v.detach().clone() for k, v in ref.model.state_dict().items()}
    assert relative_error(expected, spawned(world_size)[0]["loop"]) < 1e-5

    def losses(out):
        return [r["loss"] for r in map(json.loads, (Path(out) / "metrics.jsonl").open())]

    ours, theirs = losses(root / "ws2" / "loop"), losses(root / "ref")
    assert len(ours) == len(theirs) == 3
    assert all(abs(a - b) < 1e-5 * b for a, b in zip(ours, theirs))


def test_seeds_agree_over_tensor_parallel_ranks_and_differ_over_data_parallel(world_size,
                                                                             spawned):
    _need(world_size, 2, 4)
    digests = spawned(world_size)[0]["digests"]
    if world_size == 2:  # dp 2 (no tensor parallelism)
        assert digests[0] != digests[1]
    else:  # dp 2 x tp 2: ranks 0, 1 and ranks 2, 3
        assert digests[0] == digests[1] and digests[2] == digests[3]
        assert digests[0] != digests[2]


def _inductor_rank(rank, world_size):
    out = {}
    mesh = Mesh.data_tensor(world_size)
    for backend in (None, "inductor"):
        torch._dynamo.reset()
        model = TransformerLM(ModelConfig(**SHAPE, norm="torch"), seed=0)
        spec = {"backend": backend, "mode": None, "scope": "blocks"} if backend else None
        parallel = parallelize(model, sharding="none", ddp="none", device=CPU, lr=LR,
                               betas=(0.9, 0.95), weight_decay=0.1, mesh=mesh,
                               sequence_parallel=True, compile=spec)
        out[backend] = train(parallel)
    return out


@pytest.mark.slow
def test_inductor_gives_eager_losses_under_sequence_parallelism(world_size):
    _need(world_size, 2)
    got = run_ranks(_inductor_rank, world_size, timeout=900)[0]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got["inductor"], got[None])), got
