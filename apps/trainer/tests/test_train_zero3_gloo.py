"""``--sharding zero3`` (zero1's stage 3) on Gloo ranks: it matches one process on the full
batch, with clipping, accumulation and either resharding setting; stopping and resuming
changes nothing, bit for bit; its checkpoints resume under zero1, fsdp and one process,
and theirs under zero3; compiled blocks with activation checkpointing train alike."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from lab2_testing.ddp_testkit import bitwise_equal, relative_error
from lab2_testing.dist import run_ranks
from lab2_trainer.checkpoint.export import export
from lab2_trainer.config import ModelConfig, TrainSettings
from lab2_trainer.runtime.launch import DistContext
from lab2_trainer.training.loop import Trainer

torch.set_num_threads(1)


def tiny_settings(data, out, **overrides) -> TrainSettings:
    model = ModelConfig(context_length=16, d_model=32, n_layers=2, n_heads=2, d_ff=64,
                        norm="torch")
    # 24 sequences split evenly over 1-4 ranks x 1-2 micro-batches.
    fields = dict(model=model, data=str(data), steps=4, batch_size=24, lr=1e-2, min_lr=1e-3,
                  warmup=2, eval_every=0, eval_batches=1, out=str(out), sample_tokens=0,
                  quiet=True, plot=False, ddp="none", sharding="none", seed=0, clip=0.05)
    fields.update(overrides)
    return TrainSettings(**fields)


def params_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    state = trainer.parallel.full_model_state(trainer.ctx.rank)  # a collective with zero3
    return {k: v.detach().cpu().clone() for k, v in (state or {}).items()}


def losses(out) -> list[float]:
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines)]


def _zero3_rank(rank, world_size, data, out, single_ckpt):
    ctx = DistContext.from_process_group()
    got = {}
    # Parity: clipping every step; accumulation over two micro-batches without resharding;
    # the blocks compiled (aot_eager: traced as inductor does) and checkpointed inside.
    for name, extra in (("clip", {}),
                        ("accum", {"grad_accum": 2, "reshard_after_forward": False}),
                        ("compiled", {"compile": True, "compile_backend": "aot_eager",
                                      "activation_checkpointing": "full"})):
        t = Trainer(tiny_settings(data, f"{out}/{name}", sharding="zero3", **extra)
                    .validate(world_size), ctx)
        t.run()
        got[name] = params_of(t)
    # Stopping at step 3 and resuming is the straight run, bit for bit.
    straight = Trainer(tiny_settings(data, f"{out}/straight", steps=6, sharding="zero3"), ctx)
    straight.run()
    Trainer(tiny_settings(data, f"{out}/stopped", steps=6, sharding="zero3"), ctx).run(stop_at=3)
    resumed = Trainer(tiny_settings(data, f"{out}/resumed", steps=6, sharding="zero3",
                                    resume=f"{out}/stopped"), ctx)
    assert resumed.step == 3
    resumed.run()
    got["straight"], got["resumed"] = params_of(straight), params_of(resumed)
    # zero3's checkpoint under zero1 and fsdp; one process's (plain AdamW) under zero3.
    for kind in ("zero1", "fsdp"):
        t = Trainer(tiny_settings(data, f"{out}/{kind}-from-zero3", steps=6, sharding=kind,
                                  resume=f"{out}/stopped"), ctx)
        t.run(stop_at=5 if kind == "fsdp" else None)
        got[f"{kind}-from-zero3"] = params_of(t)
    t = Trainer(tiny_settings(data, f"{out}/zero3-from-single", steps=6, sharding="zero3",
                              resume=single_ckpt), ctx)
    t.run()
    got["zero3-from-single"] = params_of(t)
    # fsdp's step-5 checkpoint back under zero3.
    t = Trainer(tiny_settings(data, f"{out}/zero3-from-fsdp", steps=6, sharding="zero3",
                              resume=f"{out}/fsdp-from-zero3"), ctx)
    assert t.step == 5
    t.run()
    got["zero3-from-fsdp"] = params_of(t)
    return got


def test_zero3_trains_resumes_and_moves_between_kinds(world_size, corpus_dir, tmp_path):
    reference = Trainer(tiny_settings(corpus_dir, tmp_path / "ref"), DistContext())
    reference.run()
    six = Trainer(tiny_settings(corpus_dir, tmp_path / "six", steps=6), DistContext())
    six.run()
    Trainer(tiny_settings(corpus_dir, tmp_path / "single-stop", steps=6),
            DistContext()).run(stop_at=3)
    ranks = tmp_path / "ranks"
    got = run_ranks(_zero3_rank, world_size, str(corpus_dir), str(ranks),
                    str(tmp_path / "single-stop"), timeout=300)[0]
    expected, expected6 = params_of(reference), params_of(six)
    ref_losses = losses(tmp_path / "ref")
    for name in ("clip", "accum", "compiled"):
        assert relative_error(expected, got[name]) < 1e-5, name
        for ours, theirs in zip(losses(ranks / name), ref_losses, strict=True):
            assert abs(ours - theirs) < 1e-5 * abs(theirs), (name, ours, theirs)
    # Training after the resume is the straight run's, bit for bit. The logged losses are
    # the ranks' means by one all-reduce over several steps' losses at once, which Gloo
    # may sum in another order for another number of steps (seen at 4 ranks): 1 ulp.
    assert bitwise_equal(got["straight"], got["resumed"])
    for ours, theirs in zip(losses(ranks / "resumed"), losses(ranks / "straight")[3:],
                            strict=True):
        assert abs(ours - theirs) <= 4e-7 * abs(theirs), (ours, theirs)
    for key in ("straight", "zero1-from-zero3", "zero3-from-single", "zero3-from-fsdp"):
        assert relative_error(expected6, got[key]) < 1e-5, key
    # zero3's checkpoint, from world_size ranks, resumed by one process (--sharding none).
    back = Trainer(tiny_settings(corpus_dir, tmp_path / "back", steps=6,
                                 resume=str(ranks / "stopped")), DistContext())
    assert back.step == 3
    back.run()
    assert relative_error(expected6, params_of(back)) < 1e-5
    export(ranks / "stopped", tmp_path / "zero3.pt")  # the plain one-file format
    ckpt = torch.load(tmp_path / "zero3.pt", weights_only=True)
    assert ckpt["model"].keys() == six.model.state_dict().keys()
    n_params = len(list(six.model.parameters()))
    assert sorted(ckpt["optimizer"]["state"]) == list(range(n_params))


def _dies_mid_all_gather(ctx) -> None:
    import os
    import signal

    from torch import nn

    from zero1 import Stage3Optimizer, shard_model

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
    shard_model(model, units=list(model))
    opt = Stage3Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    if ctx.rank == 1:
        # In the second step's forward, after the first layers' gathers (and the next
        # one's prefetch) have started: rank 0 waits in an all-gather.
        calls = []

        def die(module, args):
            calls.append(1)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGKILL)

        model[2].register_forward_pre_hook(die)
    for _ in range(3):
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.gloo
def test_a_rank_killed_mid_all_gather_is_named(capfd):
    from lab2_trainer.runtime.launch import spawn_local

    start = time.monotonic()
    rc = spawn_local(2, "cpu", _dies_mid_all_gather, timeout_s=5)
    took = time.monotonic() - start
    err = capfd.readouterr().err
    assert rc == 1 and took < 30, (rc, took, err)
    assert "rank 1 (pid" in err and "was killed by SIGKILL" in err, err
    assert "Traceback" not in err, err
