"""Training on Gloo ranks: parity with one process on the full batch (our stack and
PyTorch's, eager and compiled), and checkpoint resume at the same and at a different
number of ranks."""

from __future__ import annotations

import torch

from lab2_testing.ddp_testkit import bitwise_equal, relative_error
from lab2_testing.dist import run_ranks
from lab2_trainer.config import ModelConfig, TrainSettings
from lab2_trainer.runtime.launch import DistContext
from lab2_trainer.training.loop import Trainer

torch.set_num_threads(1)

# ddp, sharding, norm, grad_accum: ours first, then PyTorch's, then the other variants.
VARIANTS = [
    ("bucketed", "zero1-allreduce", "tritonnorm", 1),
    ("torch", "torch", "torch", 1),
    ("bucketed", "zero1-allreduce", "reference", 2),
    ("individual", "none", "tritonnorm", 1),
    ("flat", "zero1-allreduce", "tritonnorm", 2),
    ("naive", "torch", "tritonnorm", 1),
]


def tiny_settings(data, out, **overrides) -> TrainSettings:
    norm = overrides.pop("norm", "tritonnorm")
    model = ModelConfig(context_length=16, d_model=32, n_layers=2, n_heads=2, d_ff=64, norm=norm)
    # 24 sequences split evenly over 1-4 ranks x 1-2 micro-batches.
    fields = dict(model=model, data=str(data), steps=6, batch_size=24, lr=1e-2, min_lr=1e-3,
                  warmup=2, eval_every=0, eval_batches=1, out=str(out), sample_tokens=0,
                  quiet=True, plot=False, ddp="none", sharding="none", seed=0, bucket_mb=0.002)
    fields.update(overrides)
    return TrainSettings(**fields)


def params_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _variants_rank(rank, world_size, data, out):
    ctx = DistContext.from_process_group()
    results = []
    for i, (ddp, sharding, norm, accum) in enumerate(VARIANTS):
        s = tiny_settings(data, f"{out}/v{i}", ddp=ddp, sharding=sharding, norm=norm,
                          grad_accum=accum, steps=4).validate(world_size)
        trainer = Trainer(s, ctx)
        trainer.run()
        results.append(params_of(trainer))
    return results


def test_every_stack_matches_one_process_on_the_full_batch(world_size, corpus_dir, tmp_path):
    reference = Trainer(tiny_settings(corpus_dir, tmp_path / "ref", steps=4, norm="torch"),
                        DistContext())
    reference.run()
    expected = params_of(reference)
    per_rank = run_ranks(_variants_rank, world_size, str(corpus_dir), str(tmp_path), timeout=150)
    for variant, got in zip(VARIANTS, per_rank[0]):
        err = relative_error(expected, got)
        assert err < 1e-5, (variant, err)
    for other in per_rank[1:]:  # every rank ends with the same parameters
        assert all(bitwise_equal(a, b) for a, b in zip(per_rank[0], other))
    # Ours against PyTorch's, directly.
    assert relative_error(per_rank[0][1], per_rank[0][0]) < 1e-5


def _resume_rank(rank, world_size, data, out, single_ckpt):
    ctx = DistContext.from_process_group()
    stack = dict(ddp="bucketed", sharding="zero1-allreduce")
    straight = Trainer(tiny_settings(data, f"{out}/straight", **stack), ctx)
    straight.run()
    first = Trainer(tiny_settings(data, f"{out}/stopped", **stack), ctx)
    first.run(stop_at=3)
    resumed = Trainer(tiny_settings(data, f"{out}/resumed", resume=f"{out}/stopped",
                                    **stack), ctx)
    resumed.run()
    # Resume here the checkpoint that one process wrote at step 3.
    from_single = Trainer(tiny_settings(data, f"{out}/from_single", resume=single_ckpt, **stack),
                          ctx)
    from_single.run()
    return params_of(straight), params_of(resumed), params_of(from_single)


def test_resume_is_bitwise_and_works_across_world_sizes(world_size, corpus_dir, tmp_path):
    # One process: uninterrupted, and stopped at step 3 (its checkpoint goes to the ranks).
    single = Trainer(tiny_settings(corpus_dir, tmp_path / "single"), DistContext())
    single.run()
    expected = params_of(single)
    Trainer(tiny_settings(corpus_dir, tmp_path / "single_stop"), DistContext()).run(stop_at=3)
    straight, resumed, from_single = run_ranks(
        _resume_rank, world_size, str(corpus_dir), str(tmp_path / "ranks"),
        str(tmp_path / "single_stop"), timeout=150,
    )[0]
    # Same world size: stopping and resuming changes nothing, bit for bit.
    assert bitwise_equal(straight, resumed)
    # One process -> world_size ranks, and world_size ranks (their step-3 checkpoint, each
    # rank's part of it) -> one process.
    ranks_ckpt = tmp_path / "ranks" / "stopped"
    back = Trainer(tiny_settings(corpus_dir, tmp_path / "back", resume=str(ranks_ckpt)),
                   DistContext())
    assert back.step == 3
    back.run()
    for got in (from_single, straight, params_of(back)):
        if world_size == 1:
            assert bitwise_equal(expected, got)
        else:
            assert relative_error(expected, got) < 1e-6


# A compiled model in our stack: the gradient hooks still fire inside the compiled
# backward, and training matches the uncompiled stack and one process on the full batch.
# ``aot_eager`` traces and partitions the graph as inductor does, without generating code,
# so it compiles in seconds.
COMPILE_STACK = dict(ddp="bucketed", sharding="zero1-allreduce", steps=4)


def _compiled_rank(rank, world_size, data, out):
    import torch._dynamo

    ctx = DistContext.from_process_group()
    results = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        s = tiny_settings(data, f"{out}/compiled{int(compiled)}", compile=compiled,
                          compile_backend="aot_eager", **COMPILE_STACK).validate(world_size)
        trainer = Trainer(s, ctx)
        trainer.run()
        stats = trainer.parallel.wrapper.last_sync_stats
        results[compiled] = {
            "params": params_of(trainer),
            "launched_in_backward": stats.launched_in_backward,
            "launched_in_finish": stats.launched_in_finish,
            "regions_compiled": trainer.model.regions_compiled,
            "frames": sum(torch._dynamo.utils.counters["frames"].values()),
        }
    return results


def test_compiled_stack_matches_uncompiled_and_one_process(world_size, corpus_dir, tmp_path):
    reference = Trainer(tiny_settings(corpus_dir, tmp_path / "ref", steps=4), DistContext())
    reference.run()
    expected = params_of(reference)
    per_rank = run_ranks(_compiled_rank, world_size, str(corpus_dir), str(tmp_path),
                         timeout=300)
    for res in per_rank:
        eager, compiled = res[False], res[True]
        assert compiled["regions_compiled"]  # --compile is regional by default
        assert compiled["frames"] > 0  # dynamo did trace the model
        # Every bucket was launched by the gradient hooks during the backward, compiled or
        # not (their number may differ: each learns its own gradient order, which cuts the
        # buckets).
        for run in (eager, compiled):
            assert run["launched_in_backward"] > 0 and run["launched_in_finish"] == 0
        assert relative_error(eager["params"], compiled["params"]) < 1e-5
        assert relative_error(expected, compiled["params"]) < 1e-5
    for other in per_rank[1:]:  # every rank ends with the same parameters
        assert bitwise_equal(per_rank[0][True]["params"], other[True]["params"])
