"""The trainer's ZeRO kinds on Gloo ranks: ``--sharding zero1`` and ``zero2`` (zero1's
ShardedOptimizer reduce-scattering the gradients itself, no DDP wrapper) and ``fsdp``
(PyTorch's FSDP2). Each matches one process on the full batch, loss for loss, with
clipping and with gradient accumulation; checkpoints move between kinds and world sizes,
and stopping and resuming at the same world size changes nothing, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lab2_testing.ddp_testkit import bitwise_equal, relative_error
from lab2_testing.dist import run_ranks
from lab2_trainer.checkpoint.export import export
from lab2_trainer.config import ModelConfig, TrainSettings
from lab2_trainer.runtime.launch import DistContext
from lab2_trainer.training.loop import Trainer

torch.set_num_threads(1)

# sharding, grad_accum, clip: every kind with and without accumulation; clip 0.05 clips
# every step (the tiny model's gradient norm starts near 1), 0 only measures the norm.
VARIANTS = [
    ("zero1", 1, 0.05),
    ("zero1", 2, 0.0),
    ("zero2", 1, 0.0),
    ("zero2", 2, 0.05),
    ("fsdp", 1, 0.05),
    ("fsdp", 2, 0.05),
]


def tiny_settings(data, out, **overrides) -> TrainSettings:
    model = ModelConfig(context_length=16, d_model=32, n_layers=2, n_heads=2, d_ff=64,
                        norm="torch")
    # 24 sequences split evenly over 1-4 ranks x 1-2 micro-batches; a bucket of 2 KB cuts
    # the model's gradients into many buckets.
    fields = dict(model=model, data=str(data), steps=4, batch_size=24, lr=1e-2, min_lr=1e-3,
                  warmup=2, eval_every=0, eval_batches=1, out=str(out), sample_tokens=0,
                  quiet=True, plot=False, ddp="none", sharding="none", seed=0, bucket_mb=0.002)
    fields.update(overrides)
    return TrainSettings(**fields)


def params_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    state = trainer.parallel.full_model_state(trainer.ctx.rank)  # a collective with fsdp
    return {k: v.detach().cpu().clone() for k, v in (state or {}).items()}


def curve(out) -> list[tuple[float, float]]:
    """(loss, gradient norm before clipping) of every step of a run (rank 0's records)."""
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return [(r["loss"], r["grad_norm"]) for r in map(json.loads, lines)]


def _parity_rank(rank, world_size, data, out):
    ctx = DistContext.from_process_group()
    results = []
    for i, (sharding, accum, clip) in enumerate(VARIANTS):
        s = tiny_settings(data, f"{out}/v{i}", sharding=sharding, grad_accum=accum,
                          clip=clip).validate(world_size)
        trainer = Trainer(s, ctx)
        trainer.run()
        # zero1's buckets follow the order learned in the first step (a checkpoint keeps
        # it); FSDP2 and one rank learn nothing.
        order = trainer.parallel.gradient_order
        if sharding == "fsdp" or world_size == 1:
            assert order is None
        else:
            assert sorted(order) == list(range(len(list(trainer.model.parameters()))))
        results.append(params_of(trainer))
    return results


def test_zero_and_fsdp_match_one_process_on_the_full_batch(world_size, corpus_dir, tmp_path):
    references = {}
    for clip in (0.0, 0.05):
        ref = Trainer(tiny_settings(corpus_dir, tmp_path / f"ref{clip}", clip=clip),
                      DistContext())
        ref.run()
        references[clip] = (params_of(ref), curve(tmp_path / f"ref{clip}"))
    per_rank = run_ranks(_parity_rank, world_size, str(corpus_dir), str(tmp_path / "ranks"),
                         timeout=240)
    for i, (variant, got) in enumerate(zip(VARIANTS, per_rank[0])):
        params, losses = references[variant[2]]
        assert relative_error(params, got) < 1e-5, variant
        ours = curve(tmp_path / "ranks" / f"v{i}")
        assert len(ours) == len(losses) == 4
        for (loss, norm), (ref_loss, ref_norm) in zip(ours, losses):
            assert abs(loss - ref_loss) < 1e-5 * abs(ref_loss), (variant, ours, losses)
            assert abs(norm - ref_norm) < 1e-4 * ref_norm, (variant, ours, losses)
    if world_size > 1:
        # clip 0.05 did clip: the norms are well above it
        assert min(n for _, n in references[0.05][1]) > 0.1


def _resume_rank(rank, world_size, data, out, single_ckpt):
    ctx = DistContext.from_process_group()
    got = {}
    for kind in ("zero1", "zero2"):
        straight = Trainer(tiny_settings(data, f"{out}/{kind}-straight", steps=6,
                                         sharding=kind), ctx)
        straight.run()
        Trainer(tiny_settings(data, f"{out}/{kind}-stopped", steps=6, sharding=kind),
                ctx).run(stop_at=3)
        resumed = Trainer(tiny_settings(data, f"{out}/{kind}-resumed", steps=6, sharding=kind,
                                        resume=f"{out}/{kind}-stopped"), ctx)
        assert resumed.step == 3
        resumed.run()
        got[kind] = (params_of(straight), params_of(resumed))
    # One process's step-3 checkpoint (plain AdamW), resumed by every kind at this size.
    for kind in ("zero2", "fsdp"):
        t = Trainer(tiny_settings(data, f"{out}/{kind}-from-single", steps=6, sharding=kind,
                                  resume=single_ckpt), ctx)
        t.run()
        got[f"{kind}-from-single"] = params_of(t)
    # This size's zero2 checkpoint resumed by fsdp, and back: the format is one.
    t = Trainer(tiny_settings(data, f"{out}/fsdp-from-zero2", steps=6, sharding="fsdp",
                              resume=f"{out}/zero2-stopped"), ctx)
    t.run(stop_at=5)
    t = Trainer(tiny_settings(data, f"{out}/zero1-from-fsdp", steps=6, sharding="zero1",
                              resume=f"{out}/fsdp-from-zero2"), ctx)
    assert t.step == 5
    t.run()
    got["zero2-fsdp-zero1"] = params_of(t)
    return got


def test_sharded_checkpoints_resume_bitwise_and_across_kinds_and_world_sizes(
        world_size, corpus_dir, tmp_path):
    single = Trainer(tiny_settings(corpus_dir, tmp_path / "single", steps=6), DistContext())
    single.run()
    expected = params_of(single)
    Trainer(tiny_settings(corpus_dir, tmp_path / "single-stop", steps=6),
            DistContext()).run(stop_at=3)
    ranks = tmp_path / "ranks"
    got = run_ranks(_resume_rank, world_size, str(corpus_dir), str(ranks),
                    str(tmp_path / "single-stop"), timeout=300)[0]
    # Same world size: stopping and resuming zero1 or zero2 changes nothing, bit for bit.
    for kind in ("zero1", "zero2"):
        straight, resumed = got[kind]
        assert bitwise_equal(straight, resumed), kind
        assert relative_error(expected, straight) < 1e-5, kind
    for key in ("zero2-from-single", "fsdp-from-single", "zero2-fsdp-zero1"):
        assert relative_error(expected, got[key]) < 1e-5, key
    # world_size ranks' zero2 checkpoint (its optimizer consolidated) -> one process.
    back = Trainer(tiny_settings(corpus_dir, tmp_path / "back", steps=6,
                                 resume=str(ranks / "zero2-stopped")),
                   DistContext())
    assert back.step == 3
    back.run()
    assert relative_error(expected, params_of(back)) < 1e-5
    # Every rank wrote its own part; the export is one plain file.
    manifest = json.loads((ranks / "zero2-stopped" / "ckpt" / "step-000003" / "manifest.json")
                          .read_text())
    assert sum(name.endswith(".distcp") for name in manifest["files"]) == world_size
    export(ranks / "zero2-stopped", tmp_path / "zero2.pt")
    ckpt = torch.load(tmp_path / "zero2.pt", weights_only=True)
    assert ckpt["world_size"] == world_size
    order = ckpt["gradient_order"]  # zero2's learned bucket order (none on one rank)
    assert order is None if world_size == 1 else sorted(order) == list(range(len(order)))
    # The plain AdamW format: state keyed by parameter number, the model's state dict.
    assert sorted(ckpt["optimizer"]["state"]) == list(range(len(list(single.model.parameters()))))
    assert ckpt["model"].keys() == single.model.state_dict().keys()


def _compiled_rank(rank, world_size, data, out):
    import torch._dynamo

    ctx = DistContext.from_process_group()
    results = {}
    for kind in ("zero2", "fsdp"):
        torch._dynamo.reset()
        s = tiny_settings(data, f"{out}/{kind}", sharding=kind, compile=True,
                          compile_backend="aot_eager").validate(world_size)
        trainer = Trainer(s, ctx)
        trainer.run()
        results[kind] = {"params": params_of(trainer),
                         "regions_compiled": trainer.model.regions_compiled,
                         "frames": sum(torch._dynamo.utils.counters["frames"].values())}
    return results


def test_compiled_zero2_and_fsdp_match_one_process(world_size, corpus_dir, tmp_path):
    """The bare model compiled block by block (``aot_eager``: traced and partitioned as
    inductor does, without generating code), then sharded: zero1's gradient hooks on the
    parameters and FSDP2's module hooks still fire around the compiled graphs."""
    reference = Trainer(tiny_settings(corpus_dir, tmp_path / "ref"), DistContext())
    reference.run()
    expected = params_of(reference)
    per_rank = run_ranks(_compiled_rank, world_size, str(corpus_dir), str(tmp_path),
                         timeout=300)
    for kind, res in per_rank[0].items():
        assert res["regions_compiled"] and res["frames"] > 0, kind
        assert relative_error(expected, res["params"]) < 1e-5, kind
