"""Dropout's random generators across a resume, on Gloo ranks.

Each rank's default generators are seeded per data-parallel index, so the data-parallel
ranks draw dropout masks of their own. With ``--dropout 0.1``, in the cell of world size W
(and at W = 2 and 4 also at ``--tp 2``):

* a run stopped at step 2 and resumed to step 4 has, bit for bit, the losses and the
  step-4 checkpoint (model and AdamW state) of the uninterrupted run; each rank resumes
  with exactly the generator states it had at step 2, so its data-parallel ranks draw
  masks that differ (the same over a tensor-parallel group);
* a step folder of an earlier version (rank 0's states only) still resumes, every rank
  taking rank 0's states, as before;
* at another ``--tp`` (another layout), each rank's generators are seeded afresh from the
  seed, the step and its data-parallel index: again different over the data-parallel
  ranks and alike over a tensor-parallel group.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lab2_testing.dist import run_ranks
from lab2_testing.trainer_state import same_model_and_optimizer
from lab2_trainer.checkpoint.export import export
from lab2_trainer.checkpoint.folders import (
    MANIFEST,
    TRAINER_STATE,
    load_trainer_state,
    save_trainer_state,
)
from lab2_trainer.checkpoint.rng import KEY, resume_seed
from lab2_trainer.config import ModelConfig, TrainSettings
from lab2_trainer.runtime.launch import DistContext
from lab2_trainer.training.loop import Trainer

torch.set_num_threads(1)

pytestmark = pytest.mark.timeout(900)


def settings(data, out, world_size: int, **overrides) -> TrainSettings:
    model = ModelConfig(context_length=16, d_model=32, n_layers=2, n_heads=2, d_ff=64,
                        norm="torch", dropout=0.1)
    fields = dict(model=model, data=str(data), steps=4, batch_size=24, lr=1e-2, min_lr=1e-3,
                  warmup=2, eval_every=0, eval_batches=1, out=str(out), sample_tokens=0,
                  quiet=True, plot=False, sharding="none", ddp="flat", seed=3,
                  bucket_mb=0.002, ckpt_every=2, keep_last=0, ckpt_async=False)
    fields.update(overrides)
    return TrainSettings(**fields).validate(world_size)


def step_folder(out, step: int) -> Path:
    return Path(out) / "ckpt" / f"step-{step:06d}"


def drawn() -> tuple[bytes, torch.Tensor]:
    """This rank's CPU generator state and the dropout mask it would draw next (the
    generator is put back)."""
    state = torch.get_rng_state()
    mask = F.dropout(torch.ones(512), 0.1, True) != 0
    torch.set_rng_state(state)
    return bytes(state.numpy()), mask


def as_earlier_version(source: Path, target: Path) -> None:
    """A copy of a step folder whose ``trainer.pt`` holds rank 0's random states only, as
    earlier versions wrote it (the manifest updated to match)."""
    shutil.copytree(source, target)
    small = load_trainer_state(target)
    small.pop("checksums")
    small.pop(KEY)
    size, crc = save_trainer_state(target, small)
    manifest = json.loads((target / MANIFEST).read_text())
    manifest["files"][TRAINER_STATE] = {"bytes": size, "crc32": f"{crc:08x}"}
    (target / MANIFEST).write_text(json.dumps(manifest))


def _rank(rank, world_size, data, out, tp):
    ctx = DistContext.from_process_group()
    run = lambda name, **kw: settings(data, f"{out}/{name}", world_size, tp=tp, **kw)  # noqa: E731
    Trainer(run("straight"), ctx).run()
    half = Trainer(run("half"), ctx)
    half.run(stop_at=2)
    at_step_2 = drawn()
    resumed = Trainer(run("resumed", resume=str(step_folder(f"{out}/half", 2))), ctx)
    after_resume = drawn()
    resumed.run()
    if rank == 0:
        as_earlier_version(step_folder(f"{out}/half", 2), step_folder(f"{out}/old", 2))
    dist.barrier()
    Trainer(run("from-old", resume=str(step_folder(f"{out}/old", 2))), ctx)
    from_old = drawn()
    other_tp, other = (1 if tp > 1 else 2), None
    if world_size % other_tp == 0:
        Trainer(settings(data, f"{out}/other", world_size, tp=other_tp,
                         resume=str(step_folder(f"{out}/half", 2))), ctx)
        other = drawn()
    return {"at_step_2": at_step_2, "after_resume": after_resume, "from_old": from_old,
            "other": other, "other_tp": other_tp}


def losses(out) -> dict[int, float]:
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def exported(folder: Path, target: Path) -> dict:
    export(folder, target)
    return torch.load(target, weights_only=True)


def groups(world_size: int, tp: int) -> tuple[list[list[int]], list[list[int]]]:
    """(the ranks of each data-parallel index, one rank of each data-parallel index)."""
    by_dp = [list(range(d * tp, (d + 1) * tp)) for d in range(world_size // tp)]
    return by_dp, [ranks[0] for ranks in by_dp]


@pytest.mark.parametrize("tp", [1, 2], ids=lambda n: f"tp{n}")
def test_a_resume_with_dropout_is_the_uninterrupted_run(world_size, tp, corpus_dir, tmp_path):
    if world_size % tp:
        pytest.skip(f"--tp {tp} does not divide {world_size} ranks")
    if tp > 1 and world_size not in (2, 4):
        pytest.skip("tp 2 at 2 and 4 ranks")
    out = tmp_path / "runs"
    ranks = run_ranks(_rank, world_size, str(corpus_dir), str(out), tp, timeout=840)
    straight, resumed = losses(out / "straight"), losses(out / "resumed")
    assert sorted(resumed) == [3, 4]
    assert all(resumed[s] == straight[s] for s in resumed), (straight, resumed)
    assert same_model_and_optimizer(
        exported(step_folder(out / "straight", 4), tmp_path / "a.pt"),
        exported(step_folder(out / "resumed", 4), tmp_path / "b.pt"))
    small = load_trainer_state(step_folder(out / "half", 2))
    assert small[KEY]["world_size"] == world_size and small[KEY]["tp"] == tp
    assert torch.equal(small[KEY]["ranks"][0]["cpu"], small["rng"]["cpu"])
    # Each rank resumed with its own states of step 2.
    for r in ranks:
        assert r["after_resume"][0] == r["at_step_2"][0]
        assert torch.equal(r["after_resume"][1], r["at_step_2"][1])
    by_dp, one_each = groups(world_size, tp)
    masks = [ranks[i]["after_resume"][1] for i in one_each]
    assert all(not torch.equal(a, b) for i, a in enumerate(masks) for b in masks[i + 1:])
    for group in by_dp:  # alike over a tensor-parallel group
        assert all(torch.equal(ranks[i]["after_resume"][1], ranks[group[0]]["after_resume"][1])
                   for i in group)
    # An earlier version's checkpoint: rank 0's states on every rank, as before.
    assert all(r["from_old"][0] == ranks[0]["at_step_2"][0] for r in ranks)
    # Another --tp: fresh states from the seed, the step and the data-parallel index.
    other_tp = ranks[0]["other_tp"]
    by_dp, one_each = groups(world_size, other_tp) if world_size % other_tp == 0 else ([], [])
    for d, group in enumerate(by_dp):
        torch.manual_seed(resume_seed(3, 2, d))
        expected = drawn()
        assert all(ranks[i]["other"][0] == expected[0] for i in group), (d, group)
    masks = [ranks[i]["other"][1] for i in one_each]
    assert all(not torch.equal(a, b) for i, a in enumerate(masks) for b in masks[i + 1:])
