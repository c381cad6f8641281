"""The planner's Muon (``lab2_trainer.planner.muon``) against what runs: the matrices it counts
are the ones the trainer gives Muon; its Newton-Schulz FLOPs are the products
``torch.utils.flop_counter`` counts in zero1's iteration; its owners are zero1's partition;
and on Gloo ranks (the trainer's own ``parallelize`` and ``train_step``) the owners, the
all-to-alls and their bytes are the ones the planner counts, and Muon sends nothing else
beyond AdamW's run. Then ``lab2-train plan --optimizer muon``'s figures and output."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

import zero1
from lab2_testing.dist import run_ranks
from lab2_trainer.cli.main import main
from lab2_trainer.config import ModelConfig, model_config
from lab2_trainer.models.shapes import muon_parameter_count
from lab2_trainer.models.transformer import TransformerLM
from lab2_trainer.parallel.optimizers import MuonSettings, muon_param_groups
from lab2_trainer.planner.muon import (
    NS_STEPS,
    muon_matrices,
    muon_step,
    newton_schulz_flops,
    owners,
)
from lab2_trainer.planner.plan import Hardware, PlanInput, step_time
from zero1.muon import newton_schulz

torch.set_num_threads(1)
CPU = torch.device("cpu")


# ----------------------------------------------------------------------- the matrices
@pytest.mark.parametrize("kw", [{}, {"ffn": "gelu"}, {"ffn": "relu2", "tie_embeddings": True},
                                {"rope": True, "qk_norm": True, "norm": "layernorm"}])
def test_the_planners_matrices_are_the_ones_muon_steps(kw):
    c = ModelConfig(context_length=16, d_model=32, n_layers=3, n_heads=4, d_ff=80,
                    vocab_size=64, **kw).validate()
    model = TransformerLM(c)
    _, muon = muon_param_groups(model, 0.1)
    assert [tuple(p.shape) for g in muon for p in g["params"]] == muon_matrices(c)
    assert sum(r * k for r, k in muon_matrices(c)) == muon_parameter_count(c)


def test_five_iterations_are_zero1s_default_and_the_trainers():
    assert inspect.signature(zero1.Muon).parameters["ns_steps"].default == NS_STEPS
    assert "ns_steps" not in MuonSettings(0.05).kwargs()  # the trainer keeps the default


# ---------------------------------------------------------------------- the arithmetic
@given(rows=st.integers(1, 40), cols=st.integers(1, 40), stack=st.integers(1, 3),
       steps=st.integers(0, 6), seed=st.integers(0, 2**31 - 1))
def test_newton_schulz_flops_are_the_products_counted_in_zero1s_iteration(rows, cols, stack,
                                                                          steps, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (rows, cols) if stack == 1 else (stack, rows, cols)
    matrix = torch.randn(shape, generator=gen)
    with FlopCounterMode(display=False) as counter:
        newton_schulz(matrix, steps=steps)  # bfloat16, as on a GPU
    assert counter.get_total_flops() == stack * newton_schulz_flops(rows, cols, steps)


def test_the_formula_at_a_glance():
    # 8 x 24: m = 8, n = 24; 4 m^2 n + 2 m^3 = 6144 + 1024 an iteration; tall the same.
    assert newton_schulz_flops(8, 24, 1) == newton_schulz_flops(24, 8, 1) == 7168
    # xl (SwiGLU, 48 blocks of d 1600, d_ff 6400): the record's 7.3e13 a step.
    xl = model_config("xl")
    assert sum(newton_schulz_flops(r, c) for r, c in muon_matrices(xl)) == pytest.approx(
        7.274e13, rel=1e-3)


# ------------------------------------------------------------------------- the owners
@given(sizes=st.lists(st.integers(0, 50), max_size=30), ranks=st.integers(1, 8))
def test_owners_are_zero1s_partition(sizes, ranks):
    from zero1.exchange import partition_parameters

    assert owners(sizes, ranks) == partition_parameters(sizes, ranks)


@pytest.mark.parametrize("ranks", [1, 2, 3, 5, 8, 64])
def test_the_slowest_rank_is_the_one_with_the_most_flops(ranks):
    from zero1.exchange import partition_parameters

    c = model_config("medium")
    shapes = muon_matrices(c)
    who, loads = partition_parameters([r * k for r, k in shapes], ranks)
    flops = [sum(newton_schulz_flops(*s) for s, o in zip(shapes, who) if o == r)
             for r in range(ranks)]
    for sharding in ("zero1", "zero2", "zero3", "zero1-allreduce", "torch"):
        step = muon_step(c, sharding, ranks)
        assert step.flops == max(flops) and step.largest_owned == max(loads)
        assert step.owners == (None if ranks == 1 else who)
    for sharding, dp in (("none", ranks), ("zero1", 1)):  # every rank all, or one rank
        alone = muon_step(c, sharding, dp)
        assert alone.flops == sum(newton_schulz_flops(*s) for s in shapes)
        assert alone.owners is None and alone.exchanges == ()


# ------------------------------------------------------- the exchanges on Gloo ranks
# Every Muon matrix's elements a multiple of 12 (each splits evenly over 1-4 ranks), and
# buckets so small that each matrix fills one alone, as every xl matrix does at 25 MB: the
# layout where the planner's (N-1)/N is exact for zero1 and zero2.
SHAPE = dict(context_length=8, d_model=24, n_layers=3, n_heads=4, d_ff=48, vocab_size=40)
SHARDINGS = {"zero1": "none", "zero2": "none", "zero3": "none", "zero1-allreduce": "bucketed"}
BATCH = 12
PARAMETERS = 3 * 7 + 4  # tensors: 7 a block, the two tables, the final norm and the head


def _exchanges(rank: int, world: int, sharding: str) -> dict:
    """The second step's collectives of a Muon run and of an AdamW run, and Muon's owners."""
    from lab2_trainer.parallel.parallelize import parallelize
    from lab2_trainer.training.step import train_step
    from lab2bench.comm import count_collectives

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, SHAPE["vocab_size"], (2, BATCH, SHAPE["context_length"]),
                          generator=gen) for _ in range(2)]
    per = BATCH // world
    out = {}
    for optimizer in ("muon", "adamw"):
        model = TransformerLM(ModelConfig(**SHAPE), seed=0)
        muon = MuonSettings(0.05, ns_dtype=torch.float32) if optimizer == "muon" else None
        par = parallelize(model, sharding=sharding, ddp=SHARDINGS[sharding], device=CPU,
                          lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, bucket_mb=1e-3,
                          muon=muon)
        with count_collectives() as counted:
            for x, y in data:  # the first step learns the bucket order; count the second
                counted.reset()
                train_step(par, [(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])],
                           precision="fp32", device=CPU, clip=0.0)
        a2a = [nbytes for kind, _, nbytes in counted.calls if kind == "all_to_all_single"]
        out[optimizer] = {"a2a": a2a, "other": counted.volume_bytes - sum(a2a),
                          "calls": sorted(call for call in counted.calls
                                          if call[0] != "all_to_all_single")}
        if optimizer == "muon":
            _, groups = muon_param_groups(model, 0.1)
            out["owners"] = [par.optimizer.muon.owner_of(p) for g in groups for p in g["params"]]
    return out


@pytest.mark.parametrize("sharding", list(SHARDINGS))
def test_owners_and_all_to_alls_are_the_planners(world_size, sharding):
    c = ModelConfig(**SHAPE)
    plan = muon_step(c, sharding, world_size)
    total = 4 * muon_parameter_count(c)  # fp32 bytes of every Muon matrix
    ranks = run_ranks(_exchanges, world_size, sharding, timeout=300, pg_timeout=120)
    want = plan.owners or [0] * plan.matrices
    assert all(r["owners"] == want for r in ranks)  # every rank agrees, with the planner
    for r in ranks:
        # Muon adds its all-to-alls; the buckets, units and broadcasts carry AdamW's run's
        # bytes. A second optimizer adds only scalars and flags (its part of the gradient
        # norm; stage 3's used-parameter flags again): a few bytes a parameter, uncounted.
        extra = r["muon"]["other"] - r["adamw"]["other"]
        assert 0 <= extra <= 8 * PARAMETERS, (r["muon"]["calls"], r["adamw"]["calls"])
        assert r["adamw"]["a2a"] == []
        assert len(r["muon"]["a2a"]) == len(plan.exchanges)  # one a2a each way, or none
    if not plan.exchanges:
        return
    (_, into, k_in), (_, back, _) = plan.exchanges
    spread = (world_size - 1) / world_size
    inbound = [r["muon"]["a2a"][0] for r in ranks]
    outbound = [r["muon"]["a2a"][1] for r in ranks]
    # Each direction moves (N-1)/N of every matrix (per tensor) over all ranks together.
    assert sum(outbound) == pytest.approx(spread * total, rel=0.12 if sharding == "zero3" else 0)
    assert sum(inbound) == pytest.approx(k_in * sum(outbound))
    if sharding == "zero3":
        # Its shards cut each block's flat buffer, norms and all, not each matrix: a matrix's
        # part outside its owner's shard is (N-1)/N only on average. Counted at 2-4 ranks:
        # the busiest owner within 11% of the planner's figure (README).
        assert max(outbound) == pytest.approx(spread * back, rel=0.15)
        assert max(inbound) <= spread * into * 1.15
        return
    # The owner with the most elements sends back exactly (N-1)/N of them, what it took in;
    # no rank sends more in either direction.
    assert max(outbound) == spread * back
    assert max(inbound) <= spread * into


# --------------------------------------------------------------------- the step and CLI
def test_newton_schulz_and_the_exchanges_are_in_the_step():
    xl = model_config("xl")
    hw = Hardware()
    adamw = step_time(PlanInput(xl, batch_size=16).validate())
    muon = step_time(PlanInput(xl, batch_size=16, optimizer="muon").validate())
    rate = hw.peak_tflops * 1e12 * hw.efficiency  # bf16, as the model's products
    assert muon["newton_schulz_s"] == pytest.approx(7.2745e13 / rate, rel=1e-3)
    assert muon["step_s"] == pytest.approx(adamw["step_s"] + muon["newton_schulz_s"])
    assert muon["muon"]["share_of_step"] == pytest.approx(muon["newton_schulz_s"]
                                                          / muon["step_s"])
    assert adamw["newton_schulz_s"] == 0 and adamw["muon"] is None
    eight = dict(batch_size=128, gpus_per_node=8, optimizer="muon")
    for sharding, tensors in (("zero1", 2), ("zero2", 2), ("zero3", 3)):
        t = step_time(PlanInput(xl, sharding=sharding, **eight).validate())
        muons = {k: v for k, v in t["communication"].items() if k.startswith("Muon's")}
        assert len(muons) == 2 and all(v["exposed"] == v["seconds"] for v in muons.values())
        step = muon_step(xl, sharding, 8)
        assert sum(v["bytes"] for v in muons.values()) == 4 * tensors * step.largest_owned
        assert t["newton_schulz_s"] == pytest.approx(step.flops / rate)
        # The owners share the iterations: about an eighth of one GPU's each.
        assert t["newton_schulz_s"] == pytest.approx(muon["newton_schulz_s"] / 8, rel=0.05)
    for sharding in ("none", "zero1-allreduce", "torch"):  # nothing moves beyond AdamW's
        t = step_time(PlanInput(xl, sharding=sharding, **eight).validate())
        assert not any(k.startswith("Muon's") for k in t["communication"])
    ddp = step_time(PlanInput(xl, sharding="none", **eight).validate())
    assert ddp["newton_schulz_s"] == pytest.approx(muon["newton_schulz_s"])  # every rank


def test_plan_command_prints_muons_share_of_the_step(capsys):
    argv = ["plan", "--preset", "xl", "--batch-size", "16", "--optimizer", "muon"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Muon's Newton-Schulz:" in out and "ms of the step" in out
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["time"]["muon"]["matrices"] == 240
    assert main(["plan", "--preset", "xl", "--batch-size", "16"]) == 0
    assert "Newton-Schulz" not in capsys.readouterr().out
