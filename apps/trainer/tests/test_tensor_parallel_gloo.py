"""The trainer on a ``dp x tp`` mesh, on Gloo ranks: tensor parallelism (minitp) inside,
the data-parallel families over the data-parallel ranks.

* Whole training steps in float64 (``train_step`` on a float64 model, clipping every
  step) at tp = the world (2, 3, 4 ranks) and at dp 2 x tp 2, under every family (plain
  AdamW, minddp's DDP wrappers, zero1's stages 1, 2 and 3 and its broadcasting kind,
  PyTorch's DDP and ZeroRedundancyOptimizer, FSDP2), with and without
  sequence parallelism, gradient accumulation and activation checkpointing, on two
  models (SwiGLU with tritonnorm; GELU with LayerNorm and tied embeddings): losses,
  gradient norms and the final weights, gathered whole, equal one process's on the full
  batch to float64 rounding.
* The tensor-parallel collectives of one forward and backward, counted with
  ``minitp.count_communication``, against the formula (per block two all-reduces of
  B·T·d forward and two backward; under sequence parallelism all-gathers and
  reduce-scatters of the same volume), plus the embedding, the head and the loss.
* Each rank's storage of every cut matrix: 1/tp of the whole.
* The trainer's loop (float32): a run on the mesh matches one process's run, loss for
  loss, and samples from the gathered model; under bf16 autocast it follows one process's
  bf16 run.

One set of ranks per world size runs everything (starting ranks costs more than the
steps); the tests read its results.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from lab2_testing.ddp_testkit import relative_error
from lab2_testing.dist import runs_per_world_size
from lab2_testing.lm import random_windows
from lab2_trainer.config import ModelConfig, TrainSettings
from lab2_trainer.models.transformer import TransformerLM
from lab2_trainer.parallel.mesh import Mesh
from lab2_trainer.parallel.parallelize import parallelize
from lab2_trainer.runtime.launch import DistContext
from lab2_trainer.training.loop import Trainer
from lab2_trainer.training.step import train_step
from minitp import count_communication

torch.set_num_threads(1)

# Every size divides by 2, 3 and 4: one model shape serves every tp.
SHAPE = dict(context_length=12, d_model=24, n_layers=2, n_heads=12, d_ff=48, vocab_size=48)
MODELS = {
    "swiglu": dict(norm="tritonnorm"),
    # The architecture before rope and QK-norm were the defaults: learned positions, whose
    # table is a whole parameter under sequence parallelism.
    "gelu-tied": dict(norm="layernorm", ffn="gelu", tie_embeddings=True, rope=False,
                      qk_norm=False),
}
BATCH, STEPS, CLIP, LR = 4, 3, 0.05, 1e-2
CPU = torch.device("cpu")

# (model, sharding, ddp, sequence parallel, grad_accum, activation checkpointing): at
# tp = the world (one data-parallel rank) and at dp 2 x tp 2.
ALL_TP = [
    ("swiglu", "none", "none", False, 1, "none"),
    ("swiglu", "none", "none", True, 2, "full"),
    ("swiglu", "zero2", "none", True, 1, "selective"),
    ("gelu-tied", "none", "none", True, 1, "none"),
    ("gelu-tied", "zero3", "none", False, 2, "none"),
    ("swiglu", "fsdp", "none", True, 1, "none"),
]
DP_TP = [
    ("swiglu", "none", "bucketed", False, 1, "none"),
    ("swiglu", "none", "bucketed", True, 2, "none"),
    ("swiglu", "zero1", "none", True, 1, "none"),
    ("swiglu", "zero2", "none", False, 2, "none"),
    ("swiglu", "zero3", "none", True, 2, "none"),
    ("gelu-tied", "zero2", "none", True, 1, "full"),
    ("gelu-tied", "fsdp", "none", False, 1, "none"),
    ("swiglu", "zero1-allreduce", "individual", True, 1, "none"),
    ("swiglu", "torch", "torch", False, 1, "none"),
]


def layouts(world_size: int) -> list[tuple[int, list]]:
    """(tp, configurations) of the meshes tried at ``world_size`` ranks."""
    if world_size == 1:
        return []
    out = [(world_size, ALL_TP)]
    if world_size == 4:
        out.append((2, DP_TP))
    return out


def build(kind: str) -> TransformerLM:
    return TransformerLM(ModelConfig(**SHAPE, **MODELS[kind]), seed=0).to(torch.float64)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return random_windows(STEPS, BATCH, SHAPE["vocab_size"], SHAPE["context_length"])


def set_up(kind: str, sharding: str, ddp: str, mesh: Mesh | None, sp: bool = False,
           checkpointing: str = "none"):
    model = build(kind)
    model.activation_checkpointing = checkpointing
    return parallelize(model, sharding=sharding, ddp=ddp, device=CPU, lr=LR,
                       betas=(0.9, 0.95), weight_decay=0.1, bucket_mb=0.001, mesh=mesh,
                       sequence_parallel=sp)


def train(parallel, dp_index: int, dp: int, accum: int) -> tuple[list[float], list[float]]:
    """STEPS steps on this data-parallel rank's slice of each global batch."""
    losses, norms = [], []
    for x, y in batches():
        per = BATCH // dp
        x, y = x[dp_index * per:(dp_index + 1) * per], y[dp_index * per:(dp_index + 1) * per]
        micro = per // accum
        parts = [(x[i * micro:(i + 1) * micro], y[i * micro:(i + 1) * micro])
                 for i in range(accum)]
        loss, norm = train_step(parallel, parts, precision="fp32", device=CPU, clip=CLIP)
        losses.append(float(loss))
        norms.append(float(norm))
    return losses, norms


def count_block_collectives(mesh: Mesh, sp: bool) -> dict:
    """The minitp collectives of one forward and backward on this rank's slice of the
    first batch, and of the step's sum of the whole parameters' gradients."""
    parallel = set_up("swiglu", "none", "none" if mesh.size("dp") == 1 else "bucketed", mesh,
                      sp)
    x, y = batches()[0]
    per = BATCH // mesh.size("dp")
    lo = mesh.coordinate("dp") * per
    with count_communication() as model_comm:
        _, loss = parallel(x[lo:lo + per], y[lo:lo + per])
        loss.backward()
    with count_communication() as finish_comm:
        parallel.finish()
    plain = lambda c: [(r.kind, r.phase, r.shape, r.nbytes) for r in c.records]  # noqa: E731
    return {"model": plain(model_comm), "ring": model_comm.ring_bytes(),
            "finish": plain(finish_comm)}


def storage(mesh: Mesh) -> dict[str, tuple[int, int]]:
    """(bytes of storage, elements) of each parameter of a freshly cut model."""
    model = set_up("swiglu", "none", "none" if mesh.size("dp") == 1 else "bucketed",
                   mesh).model
    return {n: (p.untyped_storage().nbytes(), p.numel()) for n, p in model.named_parameters()}


def trainer_settings(data, out, **overrides) -> TrainSettings:
    model = ModelConfig(context_length=16, d_model=32, n_layers=2, n_heads=4, d_ff=64,
                        norm="tritonnorm")
    fields = dict(model=model, data=str(data), steps=4, batch_size=8, lr=1e-2, min_lr=1e-3,
                  warmup=2, eval_every=2, eval_batches=1, out=str(out), sample_tokens=0,
                  quiet=True, plot=False, ddp="none", sharding="none", seed=0, clip=0.05,
                  bucket_mb=0.002)
    fields.update(overrides)
    return TrainSettings(**fields)


def _rank(rank, world_size, data, out):
    ctx = DistContext.from_process_group()
    results: dict = {"steps": {}, "comm": {}, "storage": {}, "replicated": {}}
    for tp, configs in layouts(world_size):
        mesh = Mesh.data_tensor(tp)
        dp_index, dp = mesh.coordinate("dp"), mesh.size("dp")
        for config in configs:
            kind, sharding, ddp, sp, accum, checkpointing = config
            parallel = set_up(kind, sharding, ddp, mesh, sp, checkpointing)
            losses, norms = train(parallel, dp_index, dp, accum)
            state = parallel.full_model_state(rank)
            results["steps"][(tp, *config)] = (losses, norms, state)
            if sharding == "none":  # whole parameters: the same on every rank of the group
                results["replicated"][(tp, *config)] = {
                    n: p.detach().clone() for n, p in parallel.model.named_parameters()
                    if not parallel.layout.is_sharded(n)}
        for sp in (False, True):
            results["comm"][(tp, sp)] = count_block_collectives(mesh, sp)
        results["storage"][tp] = storage(mesh)
    # The loop itself: dp x tp ranks drawing their batches, evaluating, sampling.
    if world_size in (2, 4):
        overrides = (dict(tp=2, sequence_parallel=True, grad_accum=2, sample_tokens=8)
                     if world_size == 2 else
                     dict(tp=2, sequence_parallel=True, sharding="zero2", sample_tokens=8))
        trainer = Trainer(trainer_settings(data, f"{out}/trainer", **overrides)
                          .validate(world_size), ctx)
        trainer.run()
        results["trainer"] = trainer.parallel.full_model_state(rank)
    if world_size == 2:  # under autocast
        trainer = Trainer(trainer_settings(data, f"{out}/bf16", tp=2, sequence_parallel=True,
                                           precision="bf16").validate(world_size), ctx)
        trainer.run()
        results["bf16"] = trainer.parallel.full_model_state(rank)
    return results


@pytest.fixture(scope="module")
def spawned(corpus_dir, tmp_path_factory):
    """``spawned(world_size)``: every rank's results, run once per world size."""
    return runs_per_world_size(_rank, str(corpus_dir),
                               root=tmp_path_factory.mktemp("tp"), timeout=420)


@functools.cache
def reference(kind: str) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """One process on the full batch."""
    parallel = set_up(kind, "none", "none", None)
    losses, norms = train(parallel, 0, 1, 1)
    return losses, norms, {k: v.clone() for k, v in parallel.model.state_dict().items()}


def _need_tp(world_size: int) -> None:
    if world_size == 1:
        pytest.skip("tensor parallelism needs at least 2 ranks")


def test_tensor_parallel_steps_match_one_process_on_the_full_batch(world_size, spawned):
    _need_tp(world_size)
    per_rank = spawned(world_size)
    steps = per_rank[0]["steps"]
    assert len(steps) == sum(len(c) for _, c in layouts(world_size))
    for key, (_, norms, state) in steps.items():
        tp, kind, _, _, _, _, _ = key
        ref_losses, ref_norms, ref_state = reference(kind)
        # The loop's loss: the mean of every rank's (float32 sums inside the step).
        losses = [sum(r["steps"][key][0][i] for r in per_rank) / world_size
                  for i in range(STEPS)]
        for ours, ref in zip(losses, ref_losses):
            assert abs(ours - ref) < 1e-6 * abs(ref), (key, losses, ref_losses)
        for ours, ref in zip(norms, ref_norms):
            assert abs(ours - ref) < 1e-12 * ref, (key, norms, ref_norms)
        assert min(ref_norms) > 10 * CLIP  # every step clipped
        assert state.keys() == ref_state.keys(), key
        assert relative_error(ref_state, state) < 1e-12, key
        for other in per_rank[1:]:  # the norm is the same everywhere
            assert other["steps"][key][1] == norms, key
    # Whole parameters stay bitwise equal over the tensor-parallel ranks.
    for key, params in per_rank[0]["replicated"].items():
        tp = key[0]
        for r in range(1, tp):
            other = per_rank[r]["replicated"][key]
            assert all(torch.equal(params[n], other[n]) for n in params), key


def _expected_collectives(dp: int, sp: bool) -> list[tuple[str, str, tuple, int]]:
    """The formula, as a sorted list: per block two collectives of B·T·d each way
    (all-reduces; under sequence parallelism all-gathers into the two regions and
    reduce-scatters out of them forward, the reverse backward); the embedding's, the
    head's, and the loss's (a max and a sum over the vocabulary: three floats a token)."""
    b, t, d = BATCH // dp, SHAPE["context_length"], SHAPE["d_model"]
    full, m = (b, t, d), b * t * d * 8
    if sp:
        one = [("all_gather", "forward", full, m), ("reduce_scatter", "forward", full, m),
               ("reduce_scatter", "backward", full, m), ("all_gather", "backward", full, m)]
    else:
        one = [("all_reduce", "forward", full, m), ("all_reduce", "backward", full, m)]
    # The embedding and the head's input make one more such pair: the embedding
    # all-reduces (scatters) forward, the head all-reduces (scatters) backward, and under
    # sequence parallelism each gathers the other way.
    n = b * t
    loss = [("all_reduce", "forward", (n,), n * 8), ("all_reduce", "forward", (2, n), 2 * n * 8)]
    return sorted(one * (2 * SHAPE["n_layers"] + 1) + loss)


def test_tensor_parallel_communication_matches_the_formula(world_size, spawned):
    _need_tp(world_size)
    d, t = SHAPE["d_model"], SHAPE["context_length"]
    for rank_results in spawned(world_size):
        for (tp, sp), got in rank_results["comm"].items():
            dp = world_size // tp
            assert sorted(got["model"]) == _expected_collectives(dp, sp), (tp, sp)
            # The same volume either way: 8 (tp - 1) / tp · B·T·d·s bytes sent per rank per
            # block, and 4 (tp - 1) / tp · B·T·d·s for the embedding and the head.
            m = BATCH // dp * t * d * 8
            ring = sum((2 if kind == "all_reduce" else 1) * (tp - 1) / tp * nbytes
                       for kind, _, shape, nbytes in got["model"] if len(shape) == 3)
            assert ring == pytest.approx((8 * SHAPE["n_layers"] + 4) * (tp - 1) / tp * m)
            # Under sequence parallelism one all-reduce more a step: the gradients of the
            # whole parameters (the norms' weights; no position table under rope), together.
            if sp:
                whole = (2 * SHAPE["n_layers"] + 1) * d
                assert got["finish"] == [("all_reduce", "backward", (whole,), whole * 8)]
            else:
                assert got["finish"] == []


def test_each_rank_holds_its_share_of_every_sharded_matrix(world_size, spawned):
    _need_tp(world_size)
    whole = {n: (p.numel(), p.element_size())
             for n, p in build("swiglu").named_parameters()}
    for rank_results in spawned(world_size):
        for tp, held in rank_results["storage"].items():
            assert held.keys() == whole.keys()
            for name, (nbytes, numel) in held.items():
                full, size = whole[name]
                cut = name.endswith(("qkv.weight", "proj.weight", "w1.weight", "w2.weight",
                                     "w3.weight")) or name in ("tok_emb.weight",
                                                               "lm_head.weight")
                assert numel == (full // tp if cut else full), (tp, name)
                assert nbytes == numel * size, (tp, name)  # its own storage, no more


def test_the_trainer_on_a_mesh_matches_one_process(world_size, spawned, corpus_dir):
    _need_tp(world_size)
    if world_size not in (2, 4):
        pytest.skip("the loop's check runs tp 2 (the byte vocabulary of 256 does not "
                    f"divide by {world_size}); at 4 ranks as dp 2 x tp 2")
    root = Path(spawned.root)
    ref = Trainer(trainer_settings(corpus_dir, root / f"ref{world_size}"), DistContext())
    ref.run()
    expected = {k: v.detach().clone() for k, v in ref.model.state_dict().items()}
    got = spawned(world_size)[0]["trainer"]
    assert relative_error(expected, got) < 1e-5

    def curve(out):
        lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
        return [(r["loss"], r["grad_norm"], r.get("val_loss")) for r in map(json.loads, lines)]

    ours, theirs = curve(root / f"ws{world_size}" / "trainer"), curve(root / f"ref{world_size}")
    assert len(ours) == len(theirs) == 4
    for (loss, norm, val), (rloss, rnorm, rval) in zip(ours, theirs):
        assert abs(loss - rloss) < 1e-5 * rloss and abs(norm - rnorm) < 1e-4 * rnorm
        assert (val is None) == (rval is None) and (val is None or abs(val - rval) < 1e-5)
    assert (root / f"ws{world_size}" / "trainer" / "sample.txt").read_text()


def test_the_trainer_on_a_mesh_under_bf16_autocast_follows_one_process(world_size, spawned,
                                                                      corpus_dir):
    _need_tp(world_size)
    if world_size != 2:
        pytest.skip("run at 2 ranks only")
    root = Path(spawned.root)
    ref = Trainer(trainer_settings(corpus_dir, root / "ref-bf16", precision="bf16"),
                  DistContext())
    ref.run()
    expected = {k: v.detach().clone() for k, v in ref.model.state_dict().items()}
    got = spawned(world_size)[0]["bf16"]
    assert relative_error(expected, got) < 1e-2

    def losses(out):
        return [r["loss"] for r in map(json.loads, (Path(out) / "metrics.jsonl").open())]

    ours, theirs = losses(root / "ws2" / "bf16"), losses(root / "ref-bf16")
    assert len(ours) == len(theirs) == 4
    for loss, ref_loss in zip(ours, theirs):
        assert abs(loss - ref_loss) < 1e-2 * ref_loss
