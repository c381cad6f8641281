"""``--keep-last`` after a resume from an older step than the newest of the run: the newer
step folders of the abandoned continuation are superseded by the resumed run's first save
(removed then, so that neither ``--keep-last`` nor ``--resume`` of the run takes them for
its newest), and the folder resumed from stays until ``--keep-last`` newer saves of the
resumed run are complete."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lab2_trainer.checkpoint.folders import (
    MANIFEST,
    complete_steps,
    prune,
    resolve,
    step_folder,
    write_manifest,
)
from lab2_trainer.config import ModelConfig, TrainSettings
from lab2_trainer.runtime.launch import DistContext
from lab2_trainer.runtime.run_folder import WriteFailed
from lab2_trainer.training.loop import Trainer

torch.set_num_threads(1)


def fake_step(root: Path, step: int, complete: bool = True) -> Path:
    """A step folder (a manifest alone is what ``complete_steps`` reads)."""
    folder = step_folder(root, step)
    folder.mkdir(parents=True)
    if complete:
        write_manifest(folder, step, {})
    return folder


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.mark.parametrize(("keep_last", "left"), [
    (1, ["step-000005"]),
    (2, ["step-000004", "step-000005"]),
    (3, ["step-000002", "step-000004", "step-000005"]),
    (0, ["step-000002", "step-000004", "step-000005"]),
])
def test_a_save_supersedes_the_newer_steps_and_keep_last_counts_its_own(tmp_path, keep_last,
                                                                        left):
    root = tmp_path / "ckpt"
    for step in (2, 4, 6, 8):  # a run to 8; resumed from 4, which saved 5
        fake_step(root, step)
    fake_step(root, 5)
    fake_step(root, 7, complete=False)  # an interrupted write of the abandoned run
    removed = prune(root, keep_last, 5)
    assert names(root) == [*left, "step-000007"]
    assert "step-000006" in removed and "step-000008" in removed
    assert resolve(tmp_path / "ckpt") == root / left[-1]


def test_nothing_complete_goes_unless_the_save_itself_is_complete(tmp_path):
    root = tmp_path / "ckpt"
    for step in (4, 8):
        fake_step(root, step)
    fake_step(root, 5, complete=False)
    assert prune(root, 1, 5) == []
    assert names(root) == ["step-000004", "step-000005", "step-000008"]


def settings(data, out, **overrides) -> TrainSettings:
    model = ModelConfig(context_length=16, d_model=32, n_layers=1, n_heads=2, d_ff=64,
                        norm="torch")
    fields = dict(model=model, data=str(data), steps=8, batch_size=8, lr=1e-2, min_lr=1e-3,
                  warmup=1, eval_every=0, eval_batches=1, out=str(out), sample_tokens=0,
                  quiet=True, plot=False, ddp="none", sharding="none", seed=0,
                  ckpt_every=4, keep_last=0, ckpt_async=False)
    fields.update(overrides)
    return TrainSettings(**fields)


@pytest.fixture(scope="module")
def run_to_8(corpus_dir, tmp_path_factory) -> Path:
    """A run of 8 steps with checkpoints at 4 and 8, both kept."""
    out = tmp_path_factory.mktemp("prune") / "run"
    Trainer(settings(corpus_dir, out), DistContext()).run()
    assert names(out / "ckpt") == ["step-000004", "step-000008"]
    return out


def copied(run: Path, tmp_path: Path) -> Path:
    import shutil

    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


@pytest.mark.parametrize(("keep_last", "left"), [
    (1, ["step-000006"]),
    (2, ["step-000005", "step-000006"]),
])
def test_a_run_resumed_from_an_older_step_keeps_its_own_last_saves(run_to_8, corpus_dir,
                                                                   tmp_path, keep_last, left):
    out = copied(run_to_8, tmp_path)
    Trainer(settings(corpus_dir, out, steps=6, ckpt_every=1, keep_last=keep_last,
                     resume=str(step_folder(out / "ckpt", 4))), DistContext()).run()
    # Before, step 8 of the abandoned run counted among the last: --keep-last 1 kept it
    # alone, removing every save of the resumed run, and --resume took it as the newest.
    assert names(out / "ckpt") == left
    assert resolve(out) == out / "ckpt" / left[-1]


def test_the_folder_resumed_from_stays_until_a_newer_save_is_complete(
        run_to_8, corpus_dir, tmp_path, disk_full_at):
    out = copied(run_to_8, tmp_path)
    disk_full_at(5)
    trainer = Trainer(settings(corpus_dir, out, steps=8, ckpt_every=1, keep_last=1,
                               ckpt_async=True, resume=str(step_folder(out / "ckpt", 4))),
                      DistContext())
    with pytest.raises(WriteFailed, match="checkpoint of step 5 was not written"):
        trainer.run(stop_at=5)  # its last save failed
    # No good save of the resumed run: the checkpoints it found are all there.
    assert [n for n, _ in complete_steps(out / "ckpt")] == [4, 8]
    assert not (step_folder(out / "ckpt", 5) / MANIFEST).exists()
