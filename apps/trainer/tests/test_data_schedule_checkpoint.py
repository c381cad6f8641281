"""Corpus loading and splits, the batch sampler, the LR schedule and atomic checkpoints."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lab2_trainer.checkpoint import single_file as ckpt_mod
from lab2_trainer.checkpoint.single_file import FORMAT, VERSION, load_checkpoint, save_atomic
from lab2_trainer.config import UsageError
from lab2_trainer.data.batches import BatchSampler, check_batch_layout
from lab2_trainer.data.corpus import DataError, is_val_file, load_corpus, unigram_entropy
from lab2_trainer.recipe.schedule import WarmupCosine


def write_text_tree(root: Path, n_files: int = 40) -> None:
    rng = np.random.default_rng(0)
    for i in range(n_files):
        sub = root / f"pkg{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        words = rng.choice(["def", "return", "x", "self", "(", ")", ":", "\n"], size=200)
        (sub / f"mod{i:02d}.py").write_text(f"# file {i}\n" + " ".join(words))


# ---------------------------------------------------------------- corpus


def test_split_by_file_is_deterministic_and_disjoint(tmp_path):
    write_text_tree(tmp_path)
    a = load_corpus(str(tmp_path))
    b = load_corpus(str(tmp_path))
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    files = sorted(tmp_path.rglob("*.py"))
    val_files = [f for f in files if is_val_file(f.relative_to(tmp_path).as_posix())]
    expected_val = b"".join(f.read_bytes() for f in val_files)
    if val_files:
        assert a.val.tobytes() == expected_val
    assert len(a.train) + len(a.val) == sum(f.stat().st_size for f in files)
    assert a.vocab_size == 256 and a.is_bytes


def test_is_val_file_is_a_fixed_function_of_the_path():
    names = [f"dir/file{i}.py" for i in range(2000)]
    picks = [is_val_file(n) for n in names]
    assert picks == [is_val_file(n) for n in names]
    assert 0.02 < sum(picks) / len(picks) < 0.09  # about 5%


def test_single_text_file_splits_by_position(tmp_path):
    path = tmp_path / "book.txt"
    path.write_bytes(bytes(range(256)) * 40)
    c = load_corpus(str(path))
    assert len(c.val) == len(c.train) * 5 // 95 or len(c.val) == 40 * 256 * 5 // 100
    assert c.train.tobytes() + c.val.tobytes() == path.read_bytes()


def test_token_arrays_npy_bin_and_split_folder(tmp_path):
    tokens = (np.arange(5000) * 7 % 1000).astype(np.uint16)
    np.save(tmp_path / "toks.npy", tokens)
    tokens.tofile(tmp_path / "toks.bin")
    for name in ("toks.npy", "toks.bin"):
        c = load_corpus(str(tmp_path / name), vocab_size=1000)
        assert not c.is_bytes and c.vocab_size == 1000
        assert np.array_equal(np.concatenate([c.train, c.val]), tokens)
    folder = tmp_path / "split"
    folder.mkdir()
    tokens[:4000].tofile(folder / "train.bin")
    np.save(folder / "val.npy", tokens[4000:])
    c = load_corpus(str(folder), vocab_size=1000)
    assert len(c.train) == 4000 and len(c.val) == 1000
    with pytest.raises(DataError, match="--vocab-size"):
        load_corpus(str(tmp_path / "toks.npy"))
    with pytest.raises(DataError, match="not below --vocab-size 500"):
        load_corpus(str(tmp_path / "toks.npy"), vocab_size=500)


def test_missing_path_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        load_corpus(str(tmp_path / "nope"))


def test_unigram_entropy_of_known_distributions():
    assert unigram_entropy(np.zeros(100, dtype=np.uint8), 256) == 0.0
    uniform = np.arange(256, dtype=np.uint8).repeat(3)
    assert math.isclose(unigram_entropy(uniform, 256), math.log(256), rel_tol=1e-12)
    two = np.array([0, 0, 0, 1], dtype=np.uint8)
    expected = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert math.isclose(unigram_entropy(two, 256), expected, rel_tol=1e-12)


# ---------------------------------------------------------------- sampler


@given(world=st.integers(1, 4), accum=st.integers(1, 3), per=st.integers(1, 3),
       seed=st.integers(0, 1000))
def test_ranks_slices_concatenate_to_the_global_batch(world, accum, per, seed):
    tokens = np.random.default_rng(seed).integers(0, 256, 3000).astype(np.uint8)
    batch = world * accum * per
    reference = BatchSampler(tokens, 8, batch, seed).next_global()
    pieces = []
    for rank in range(world):
        sampler = BatchSampler(tokens, 8, batch, seed)
        for x, y in sampler.next_local(rank, world, accum):
            assert x.shape == (per, 8) and torch.equal(x[:, 1:], y[:, :-1])
            pieces.append(torch.cat([x, y[:, -1:]], dim=1))
    assert torch.equal(torch.cat(pieces), torch.from_numpy(reference))


def test_sampler_state_resumes_the_same_stream():
    tokens = np.arange(10_000, dtype=np.uint16) % 256
    a = BatchSampler(tokens, 16, 4, seed=5)
    first = [a.next_global() for _ in range(5)]
    b = BatchSampler(tokens, 16, 4, seed=5)
    b.next_global()
    b.next_global()
    c = BatchSampler(tokens, 16, 4, seed=5)
    c.load_state_dict(b.state_dict())
    assert all(np.array_equal(c.next_global(), first[i]) for i in range(2, 5))
    with pytest.raises(DataError, match="seed"):
        BatchSampler(tokens, 16, 4, seed=6).load_state_dict(b.state_dict())
    with pytest.raises(DataError, match="cannot fill one window"):
        BatchSampler(tokens[:10], 16, 4, seed=5)


def test_batch_layout_errors_name_the_numbers():
    check_batch_layout(12, 3, 2)
    with pytest.raises(DataError, match="not divisible by world_size x grad_accum = 2 x 2"):
        check_batch_layout(6, 2, 2)
    with pytest.raises(DataError, match="cannot feed 8 rank"):
        check_batch_layout(4, 8, 1)


# ---------------------------------------------------------------- schedule


def test_warmup_cosine_values():
    s = WarmupCosine(max_lr=1.0, min_lr=0.1, warmup=10, total=110)
    assert s(0) == pytest.approx(0.1)
    assert s(9) == pytest.approx(1.0)
    assert s(10) == pytest.approx(1.0)
    assert s(60) == pytest.approx(0.55)  # halfway through the cosine
    assert s(110) == pytest.approx(0.1) and s(500) == pytest.approx(0.1)
    decay = [s(i) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    assert WarmupCosine.from_state_dict(s.state_dict()) == s
    assert WarmupCosine(1.0, 0.0, 0, 10)(0) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        WarmupCosine(1.0, 2.0, 0, 10)


# ---------------------------------------------------------------- checkpoints


def test_save_atomic_keeps_the_old_file_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    save_atomic({"a": torch.ones(3)}, path)

    def broken_save(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_mod.torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_atomic({"a": torch.zeros(3)}, path)
    monkeypatch.undo()
    assert torch.equal(torch.load(path, weights_only=True)["a"], torch.ones(3))
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # no temporary left behind


def test_an_interrupt_inside_torch_save_stays_an_interrupt(tmp_path, monkeypatch):
    # torch's zip writer turns a KeyboardInterrupt (Ctrl-C, or SIGTERM in the trainer)
    # into RuntimeError("unexpected pos ..."); the run must stop as interrupted.
    path = tmp_path / "ckpt.pt"
    save_atomic({"a": torch.ones(3)}, path)

    def interrupted_save(obj, f):
        f.write(b"partial")
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos") from None

    monkeypatch.setattr(ckpt_mod.torch, "save", interrupted_save)
    with pytest.raises(KeyboardInterrupt):
        save_atomic({"a": torch.zeros(3)}, path)
    monkeypatch.undo()
    assert torch.equal(torch.load(path, weights_only=True)["a"], torch.ones(3))
    assert os.listdir(tmp_path) == ["ckpt.pt"]


def test_load_checkpoint_rejects_corrupt_foreign_and_old_files(tmp_path):
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"this is not a checkpoint")
    with pytest.raises(UsageError, match="cannot read checkpoint"):
        load_checkpoint(corrupt)
    truncated = tmp_path / "truncated.pt"
    save_atomic({"format": FORMAT, "version": VERSION, "x": torch.ones(1000)}, truncated)
    truncated.write_bytes(truncated.read_bytes()[:300])
    with pytest.raises(UsageError, match="cannot read checkpoint"):
        load_checkpoint(truncated)
    foreign = tmp_path / "foreign.pt"
    save_atomic({"weights": torch.ones(2)}, foreign)
    with pytest.raises(UsageError, match="not a lab2-trainer checkpoint"):
        load_checkpoint(foreign)
    old = tmp_path / "old.pt"
    save_atomic({"format": FORMAT, "version": 0}, old)
    with pytest.raises(UsageError, match="version 0"):
        load_checkpoint(old)
    with pytest.raises(UsageError, match="not found"):
        load_checkpoint(tmp_path / "missing.pt")
