"""What a resume does with the random generator states of a checkpoint, in one process:
each rank's own at the same layout, fresh ones from the seed, the step and the
data-parallel index at another (with a note), rank 0's from an earlier version's
checkpoint; damaged per-rank states are refused in one line. The ranks themselves:
``test_rng_resume_gloo``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lab2_trainer.checkpoint.folders import load_trainer_state, save_trainer_state
from lab2_trainer.checkpoint.rng import (
    KEY,
    by_rank,
    check_saved,
    restore,
    resume_seed,
    rng_state,
)
from lab2_trainer.config import ModelConfig, TrainSettings, UsageError
from lab2_trainer.runtime.launch import DistContext
from lab2_trainer.training.loop import Trainer

torch.set_num_threads(1)
CPU = torch.device("cpu")


def states(n: int) -> list[dict[str, torch.Tensor]]:
    """``n`` ranks' states, each of its own seed."""
    out = []
    for seed in range(n):
        torch.manual_seed(100 + seed)
        out.append(rng_state(CPU))
    return out


def small(saved: list[dict[str, torch.Tensor]] | None, tp: int = 1, step: int = 7) -> dict:
    ckpt = {"rng": (saved or states(1))[0], "step": step}
    if saved is not None:
        ckpt[KEY] = by_rank(saved, tp)
    return ckpt


@pytest.fixture(autouse=True)
def _keep_the_generator():
    kept = torch.get_rng_state()
    yield
    torch.set_rng_state(kept)


def test_each_rank_takes_its_own_states_back_at_the_same_layout():
    saved = states(4)
    for rank in range(4):
        note = restore(small(saved, tp=2), CPU, rank=rank, world_size=4, tp=2,
                       dp_index=rank // 2, seed=0)
        assert note is None
        assert torch.equal(torch.get_rng_state(), saved[rank]["cpu"])


@pytest.mark.parametrize(("ranks", "tp"), [(2, 1), (4, 1), (4, 4), (1, 1)])
def test_another_layout_seeds_each_rank_afresh_by_its_data_parallel_index(ranks, tp):
    ckpt = small(states(4), tp=2, step=7)
    got = {}
    for rank in range(ranks):
        dp_index = rank // tp
        note = restore(ckpt, CPU, rank=rank, world_size=ranks, tp=tp,
                       dp_index=dp_index, seed=5)
        assert note is not None and "saved by 4 rank(s) at --tp 2" in note
        assert f"this run has {ranks} at --tp {tp}" in note
        assert "seeded afresh from --seed 5, step 7" in note
        got[rank] = torch.get_rng_state()
        torch.manual_seed(resume_seed(5, 7, dp_index))
        assert torch.equal(got[rank], torch.get_rng_state())
    # Different over the data-parallel indices, alike over a tensor-parallel group.
    for a in got:
        for b in got:
            assert torch.equal(got[a], got[b]) == (a // tp == b // tp), (a, b)


def test_the_fresh_seeds_depend_on_seed_step_and_index_only():
    seeds = {resume_seed(s, step, d) for s in (0, 1) for step in (1, 2) for d in (0, 1, 2)}
    assert len(seeds) == 12
    assert all(0 <= s < 2**64 for s in seeds)
    assert resume_seed(3, 10, 1) == resume_seed(3, 10, 1)


def test_an_earlier_versions_checkpoint_gives_every_rank_rank_0s_states():
    ckpt = small(None)
    for rank, world_size, tp in ((0, 1, 1), (1, 2, 2), (3, 4, 1)):
        note = restore(ckpt, CPU, rank=rank, world_size=world_size, tp=tp,
                       dp_index=rank // tp, seed=0)
        assert torch.equal(torch.get_rng_state(), ckpt["rng"]["cpu"])
        # Said only where data-parallel ranks then share masks.
        assert (note is None) == (world_size // tp == 1), note


@pytest.mark.parametrize(("entry", "fragment"), [
    ("abc", "is not a dict with a world_size and a tp of at least 1"),
    ({"world_size": 0, "tp": 1, "ranks": []}, "at least 1"),
    ({"world_size": 2, "tp": True, "ranks": []}, "at least 1"),
    ({"world_size": 2, "tp": 1, "ranks": []}, "does not hold the random states of 2 rank(s)"),
    ({"world_size": 3, "tp": 2, "ranks": [None] * 3}, "of 3 rank(s) at tp 2"),
    ({"world_size": 2, "tp": 1, "ranks": [{"cpu": torch.zeros(2)}, None]},
     "rank 0's CPU random state is unusable"),
    ({"world_size": 2, "tp": 1, "ranks": [None, None]}, "rank 0's random state is not a dict"),
], ids=["text", "zero", "bool", "short", "tp", "cpu", "none"])
def test_damaged_per_rank_states_are_refused_in_one_line(entry, fragment):
    with pytest.raises(UsageError, match="checkpoint here: ") as err:
        check_saved(entry, "here")
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_good_and_missing_per_rank_states_pass():
    check_saved(None, "here")
    check_saved(by_rank(states(2), 1), "here")
    check_saved(by_rank(states(4), 2), "here")


def settings(data, out, **overrides) -> TrainSettings:
    model = ModelConfig(context_length=16, d_model=32, n_layers=1, n_heads=2, d_ff=64,
                        norm="torch", dropout=0.1)
    fields = dict(model=model, data=str(data), steps=3, batch_size=8, lr=1e-2, min_lr=1e-3,
                  warmup=1, eval_every=0, eval_batches=1, out=str(out), sample_tokens=0,
                  quiet=True, plot=False, ddp="none", sharding="none", seed=4,
                  ckpt_every=2, keep_last=0, ckpt_async=False)
    fields.update(overrides)
    return TrainSettings(**fields)


def test_a_resume_on_another_layout_says_so_and_seeds_afresh(corpus_dir, tmp_path, capsys):
    Trainer(settings(corpus_dir, tmp_path / "run"), DistContext()).run(stop_at=2)
    folder = Path(tmp_path / "run" / "ckpt" / "step-000002")
    state = load_trainer_state(folder)
    assert state[KEY]["world_size"] == 1 and len(state[KEY]["ranks"]) == 1
    assert torch.equal(state[KEY]["ranks"][0]["cpu"], state["rng"]["cpu"])
    # As if two data-parallel ranks had saved it (the Trainer reads trainer.pt as sealed;
    # the manifest is the launcher's check).
    state.pop("checksums")
    state[KEY] = by_rank(states(2), 1)
    save_trainer_state(folder, state)
    capsys.readouterr()
    Trainer(settings(corpus_dir, tmp_path / "again", resume=str(folder)), DistContext())
    got = torch.get_rng_state()
    torch.manual_seed(resume_seed(4, 2, 0))
    assert torch.equal(got, torch.get_rng_state())
    err = capsys.readouterr().err
    assert err.startswith("lab2-train: note: the checkpoint's random generator states were "
                          "saved by 2 rank(s) at --tp 1, this run has 1 at --tp 1"), err
    # Without dropout nothing random is drawn while training: nothing to say.
    Trainer(settings(corpus_dir, tmp_path / "plain", resume=str(folder),
                     model=ModelConfig(context_length=16, d_model=32, n_layers=1, n_heads=2,
                                       d_ff=64, norm="torch")), DistContext())
    assert capsys.readouterr().err == ""
