"""The planner with tensor parallelism (``--tp``, ``--sequence-parallel``) and its layout
recommendation (``lab2-train plan --recommend``): arithmetic checked against its own
definitions and against the whole-model plan at tp 1; the refusals."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from lab2_testing.cli import run_main
from lab2_trainer.config import model_config
from lab2_trainer.models.shapes import parameter_counts, rank_parameter_counts
from lab2_trainer.planner.layout import recommend, tp_choices
from lab2_trainer.planner.plan import (
    ACTIVATION_BYTES,
    PlanInput,
    layer_activation_bytes,
    plan,
)


@pytest.mark.parametrize("preset", ["small", "2.7B", "13B"])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("rope", [True, False])
def test_each_rank_holds_a_tp_th_of_the_matrices_and_tables(preset, tp, rope):
    c = model_config(preset, rope=rope)
    whole, local = parameter_counts(c), rank_parameter_counts(c, tp)
    table = 0 if rope else c.context_length * c.d_model  # the position table, whole
    replicated = table + whole["norms"] + c.n_layers * (whole["block"] - whole["block_matmul"])
    assert local["total"] * tp == pytest.approx(whole["total"] + (tp - 1) * replicated)
    assert local["block_matmul"] * tp == whole["block_matmul"]


def test_tp_1_is_the_whole_model_s_plan():
    p = PlanInput(model=model_config("xl"), batch_size=32, precision="bf16")
    same = dataclasses.replace(p, tp=1, sequence_parallel=False)
    assert plan(p) == plan(same)
    assert plan(p)["parameters_per_gpu"] == parameter_counts(p.model)["total"]


def test_tp_cuts_the_inner_activations_and_sp_the_stream():
    c = model_config("2.7B")
    whole = layer_activation_bytes(c, "bf16")
    tp2 = layer_activation_bytes(c, "bf16", tp=2)
    sp2 = layer_activation_bytes(c, "bf16", tp=2, sequence_parallel=True)
    assert sp2 < tp2 < whole
    a, d = ACTIVATION_BYTES["bf16"], c.d_model
    stream = 2 * (4 * d + a * d)  # the norms' input and output, whole per token
    assert whole - tp2 == pytest.approx((whole - stream) / 2)
    assert tp2 - sp2 == pytest.approx(stream / 2 - 2 * a * d)  # gathered inputs kept whole


def test_tensor_parallel_bytes_follow_the_formula():
    c = model_config("2.7B")
    for sp in (False, True):
        p = PlanInput(model=c, batch_size=16, gpus_per_node=8, tp=4, sequence_parallel=sp,
                      precision="bf16", grad_accum=2)
        comms = plan(p)["time"]["communication"]
        want = (2 * c.n_layers + 1) * 2 * p.micro_batch * c.context_length * c.d_model * 2
        assert comms["tensor-parallel forward"]["bytes"] == want
        assert comms["tensor-parallel backward"]["bytes"] == want
        assert comms["tensor-parallel forward"]["exposed"] == comms[
            "tensor-parallel forward"]["seconds"]


def test_the_data_parallel_ranks_shard_the_local_state():
    c = model_config("13B")
    p = PlanInput(model=c, batch_size=64, gpus_per_node=8, tp=4, sharding="zero3",
                  precision="bf16")
    items = plan(p)["memory_bytes"]
    n = rank_parameter_counts(c, 4)["total"]
    assert items["optimizer"] == 8 * n // 2  # AdamW's moments over dp = 8 / 4
    assert p.dp == 2 and p.micro_batch == 32


@pytest.mark.parametrize(("change", "words"), [
    (dict(tp=3), "--gpus-per-node"),
    (dict(tp=64, gpus_per_node=64), "--n-heads"),
    (dict(tp=2, sequence_parallel=False, model=model_config("xl")), "--n-heads 25"),
    (dict(tp=1, sequence_parallel=True), "--tp > 1"),
    (dict(tp=0), "--tp must be"),
])
def test_bad_tensor_parallel_layouts_are_refused(change, words):
    p = dataclasses.replace(PlanInput(model=model_config("2.7B"), batch_size=64,
                                      gpus_per_node=8), **change)
    with pytest.raises(ValueError, match=words.replace("+", r"\+")):
        p.validate()


def test_the_recommendation_fits_and_is_the_fastest_it_weighed():
    p = PlanInput(model=model_config("13B"), batch_size=256, gpus_per_node=8,
                  precision="bf16", compile=True)
    advice = recommend(p)
    best = advice["best"]
    assert best is not None and all(best["step_s"] <= r["step_s"] for r in advice["rows"])
    q = dataclasses.replace(p, tp=best["tp"], sequence_parallel=best["sequence_parallel"],
                            sharding=best["sharding"], ddp=None,
                            activation_checkpointing=best["activation_checkpointing"],
                            grad_accum=best["grad_accum"])
    assert plan(q)["fits"]
    assert {r["tp"] for r in advice["by_tp"]} == set(tp_choices(p)) == {1, 2, 4, 8}
    assert advice["flags"].startswith(f"--tp {best['tp']}")


def test_across_nodes_the_recommendation_is_two_dimensional():
    """Where the data-parallel ring crosses InfiniBand, cutting the gradients by tp within
    the node wins (a prediction: no multi-node run has checked it)."""
    p = PlanInput(model=model_config("13B"), batch_size=256, gpus_per_node=8, nodes=4,
                  precision="bf16", compile=True)
    advice = recommend(p)
    assert advice["best"]["tp"] > 1
    zero3 = [r for r in advice["rows"] if r["tp"] == 1 and r["sharding"] == "zero3"]
    assert zero3 and zero3[0]["step_s"] > advice["best"]["step_s"]


def test_the_command_line_recommends_and_refuses():
    run = run_main("lab2_trainer.cli.main", [
        "plan", "--preset", "13B", "--gpus-per-node", "8", "--batch-size", "256",
        "--precision", "bf16", "--compile", "--recommend", "--json"])
    assert run.code == 0, run
    rec = json.loads(run.out)["recommendation"]
    assert rec["flags"].startswith("--tp ") and rec["best"]["tp"] in (1, 2, 4, 8)
    bad = subprocess.run([sys.executable, "-m", "lab2_trainer.cli", "plan", "--preset", "2.7B",
                          "--tp", "3", "--gpus-per-node", "8"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--tp 3" in bad.stderr


def test_the_memory_check_before_a_run_counts_each_rank_s_share(monkeypatch):
    """13B at --tp 8 on 8 GPUs of 80 GB: a rank holds an eighth of the matrices, so the check
    before a run lets it through, where counting the whole model per rank refused it."""
    import torch

    from lab2_trainer.cli.checks import check_memory
    from lab2_trainer.config import TrainSettings, UsageError

    gpu = type("Properties", (), {"total_memory": 80 * 1024**3})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: gpu)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    s = TrainSettings(model=model_config("13B"), tp=8, nproc=8, sharding="none", ddp="none",
                      batch_size=8)
    check_memory(s, 8, "cuda")  # 13B / 8 x 16 bytes = 26 GB a rank: fits
    with pytest.raises(UsageError, match="per GPU"):
        check_memory(dataclasses.replace(s, tp=1), 8, "cuda")  # 208 GB a rank: does not


def test_a_rank_s_count_has_no_position_table_under_rope():
    plain, rope = model_config("small", rope=False), model_config("small", rope=True)
    table = plain.context_length * plain.d_model
    for tp in (1, 2, 4):
        assert rank_parameter_counts(rope, tp)["total"] == \
            rank_parameter_counts(plain, tp)["total"] - table
