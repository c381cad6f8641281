"""``--stdlib-share``: training windows mixed from two streams. Each window comes whole from
one stream, with the stream's share as its probability; a mixed stream is a function of
(seed, draw) alone, so it resumes bit for bit; a sampler without a mix draws what it always
drew; and the share is refused wherever it cannot mean anything."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lab2_trainer.cli.main import main
from lab2_trainer.config import ModelConfig, TrainSettings
from lab2_trainer.data.batches import BatchSampler
from lab2_trainer.data.corpus import DataError, load_corpus, load_stdlib_corpus
from lab2_trainer.runtime.launch import DistContext
from lab2_trainer.training.loop import Trainer

torch.set_num_threads(1)

#: Token values that tell the streams apart: the main stream's are below 100, the mixed-in
#: one's 200 and above.
MAIN, MIXED = 100, 200


def streams(seed: int, n_main: int = 5_000, n_mixed: int = 700) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, MAIN, n_main).astype(np.uint8),
            rng.integers(MIXED, 256, n_mixed).astype(np.uint8))


@settings(deadline=None, max_examples=40)
@given(seed=st.integers(0, 10_000), share=st.floats(0.05, 0.95), batch=st.integers(1, 16),
       context=st.integers(1, 32))
def test_each_window_comes_whole_from_one_stream_and_resumes(seed, share, batch, context):
    main_stream, mixed = streams(seed)
    a = BatchSampler(main_stream, context, batch, seed, mix=((mixed, share),))
    draws = [a.next_global() for _ in range(4)]
    for windows in draws:
        assert windows.shape == (batch, context + 1) and windows.dtype == np.int64
        from_mixed = windows >= MIXED
        assert np.all(from_mixed.all(axis=1) | (~from_mixed).all(axis=1))
    # Resumed from its position (as a checkpoint does), the same next windows.
    b = BatchSampler(main_stream, context, batch, seed, mix=((mixed, share),))
    b.load_state_dict({**a.state_dict(), "draws": 2})
    assert all(np.array_equal(b.next_global(), draws[i]) for i in (2, 3))


@settings(deadline=None, max_examples=30)
@given(world=st.integers(1, 4), accum=st.integers(1, 3), per=st.integers(1, 3),
       seed=st.integers(0, 1000), share=st.floats(0.05, 0.95))
def test_ranks_slices_of_a_mixed_batch_concatenate_to_it(world, accum, per, seed, share):
    main_stream, mixed = streams(seed)
    batch = world * accum * per
    reference = BatchSampler(main_stream, 8, batch, seed, mix=((mixed, share),)).next_global()
    pieces = []
    for rank in range(world):
        sampler = BatchSampler(main_stream, 8, batch, seed, mix=((mixed, share),))
        for x, y in sampler.next_local(rank, world, accum):
            pieces.append(torch.cat([x, y[:, -1:]], dim=1))
    assert torch.equal(torch.cat(pieces), torch.from_numpy(reference))


def test_the_share_of_windows_is_the_stream_share():
    main_stream, mixed = streams(0)
    sampler = BatchSampler(main_stream, 8, 64, seed=3, mix=((mixed, 0.25),))
    windows = np.concatenate([sampler.next_global() for _ in range(100)])
    observed = float(np.mean(windows[:, 0] >= MIXED))
    # 6,400 Bernoulli(0.25) draws: the standard deviation of the mean is 0.0054.
    assert abs(observed - 0.25) < 0.03


def test_without_a_mix_the_windows_are_those_of_the_offsets():
    main_stream, _ = streams(1)
    sampler = BatchSampler(main_stream, 16, 8, seed=9)
    for draw in range(3):
        starts = sampler.offsets(draw)
        expected = main_stream[starts[:, None] + np.arange(17)].astype(np.int64)
        assert np.array_equal(sampler.next_global(), expected)


@pytest.mark.parametrize("mix", [((None, 0.0),), ((None, 1.0),), ((None, 0.6), (None, 0.5))])
def test_shares_outside_the_range_are_refused(mix):
    main_stream, mixed = streams(2)
    with pytest.raises(DataError, match="shares"):
        BatchSampler(main_stream, 8, 4, 0, mix=tuple((mixed, s) for _, s in mix))


def test_a_mixed_stream_too_short_for_a_window_is_refused():
    main_stream, mixed = streams(2)
    with pytest.raises(DataError, match="cannot fill one window"):
        BatchSampler(main_stream, 8, 4, 0, mix=((mixed[:5], 0.5),))


def test_load_corpus_mixes_the_standard_library_and_says_so(corpus_dir):
    plain = load_corpus(str(corpus_dir))
    mixed = load_corpus(str(corpus_dir), stdlib_share=0.3)
    assert plain.mix == () and "mix" not in plain.identity()
    (tokens, share), = mixed.mix
    assert share == 0.3 and np.array_equal(tokens, load_stdlib_corpus().train)
    assert mixed.identity()["mix"] == [[0.3, len(tokens)]]
    assert np.array_equal(mixed.val, plain.val)  # validation stays --data's own
    assert "(70% of windows)" in mixed.describe() and "(30%)" in mixed.describe()


def test_load_corpus_refusals(corpus_dir, tmp_path):
    with pytest.raises(DataError, match="without --data"):
        load_corpus(None, stdlib_share=0.2)
    for share in (1.0, float("nan"), None, "0.2"):
        with pytest.raises(DataError, match=r"in \[0, 1\)"):
            load_corpus(str(corpus_dir), stdlib_share=share)
    array = tmp_path / "tokens.npy"
    np.save(array, np.arange(4_000, dtype=np.uint16) % 500)
    with pytest.raises(DataError, match="token array"):
        load_corpus(str(array), 500, stdlib_share=0.2)


def test_settings_refuse_a_share_before_any_work():
    with pytest.raises(ValueError, match=r"--stdlib-share must be in \[0, 1\)"):
        TrainSettings(data="x", stdlib_share=1.5).validate(1)
    with pytest.raises(ValueError, match=r"--stdlib-share must be in \[0, 1\), got None"):
        TrainSettings(data="x", stdlib_share=None).validate(1)
    with pytest.raises(ValueError, match="without --data"):
        TrainSettings(stdlib_share=0.5).validate(1)


def tiny_settings(data: str, out, **fields) -> TrainSettings:
    model = ModelConfig(d_model=32, d_ff=64, n_layers=1, n_heads=2, context_length=16)
    return TrainSettings(model=model, data=data, stdlib_share=0.5, steps=6, batch_size=4,
                         eval_every=0, eval_batches=1, sample_tokens=0, log_every=1,
                         ckpt_every=3, device_type="cpu", quiet=True, plot=False, nproc=1,
                         out=str(out), **fields).validate(1)


def test_a_mixed_run_resumes_bit_for_bit(corpus_dir, tmp_path):
    straight = Trainer(tiny_settings(str(corpus_dir), tmp_path / "a"), DistContext())
    straight.run()
    first = Trainer(tiny_settings(str(corpus_dir), tmp_path / "b"), DistContext())
    first.run(stop_at=3)
    resumed = Trainer(tiny_settings(str(corpus_dir), tmp_path / "b",
                                    resume=str(tmp_path / "b")), DistContext())
    assert resumed.step == 3
    resumed.run()
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


SMALL = ["--preset", "tiny", "--batch-size", "8", "--eval-batches", "1", "--sample-tokens",
         "0", "--quiet", "--no-plot", "--nproc", "1", "--device", "cpu"]


def test_lab2_train_with_a_share_and_a_resume_with_another(corpus_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["--data", str(corpus_dir), "--stdlib-share", "0.25", "--steps", "2",
                 "--out", str(out), *SMALL]) == 0
    assert "stdlib_share = 0.25" in (out / "settings.toml").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["stdlib_share"] == 0.25
    capsys.readouterr()
    assert main(["--resume", str(out), "--steps", "3", "--stdlib-share", "0.5"]) == 2
    assert "checkpoint was trained on" in capsys.readouterr().err
    assert main(["--data", str(corpus_dir), "--stdlib-share", "2", "--steps", "2",
                 "--out", str(tmp_path / "bad"), *SMALL]) == 2
    assert "--stdlib-share must be in [0, 1)" in capsys.readouterr().err
