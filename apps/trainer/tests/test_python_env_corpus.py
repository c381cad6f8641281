"""``--data python-env`` on a small fake environment (a folder standing for the standard
library and one for site-packages, passed through ``environment_roots``): every source once,
the default corpus's validation split held out, the build's limits, the cache, memory maps,
and batches that resume where they left off."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from lab2_trainer.cli.main import main
from lab2_trainer.config import ModelConfig, TrainSettings
from lab2_trainer.data import corpus as corpus_mod
from lab2_trainer.data.batches import BatchSampler
from lab2_trainer.data.corpus import (
    PYTHON_ENV,
    DataError,
    is_val_file,
    load_corpus,
    load_python_env_corpus,
    load_stdlib_corpus,
)
from lab2_trainer.runtime.launch import DistContext
from lab2_trainer.training.loop import Trainer

torch.set_num_threads(1)


def source(name: str, lines: int = 40) -> bytes:
    """A Python source that names itself on every line (so that its bytes can be found)."""
    return "".join(f"def {name}_{i}(x):  # {name}\n    return x + {i}\n"
                   for i in range(lines)).encode()


def val_names(count: int) -> list[str]:
    """``count`` module names that the hash-of-path rule puts in the validation split."""
    found, i = [], 0
    while len(found) < count:
        if is_val_file(f"vmod{i}.py"):
            found.append(f"vmod{i}")
        i += 1
    return found


@pytest.fixture
def fake_env(tmp_path, monkeypatch):
    """(stdlib, site-packages): 30 training modules and 2 validation modules in the first; in
    the second a package with a duplicate, a copy of a validation file, a file over the size
    limit, a broken link, a FIFO, a non-Python file and bytecode. The reader and the cache
    are pointed at them."""
    stdlib, site = tmp_path / "lib", tmp_path / "site-packages"
    (stdlib / "pkg").mkdir(parents=True)
    assert not is_val_file("pkg/inner.py")
    for i in range(30):
        name = f"mod{i}"
        if not is_val_file(f"{name}.py"):
            (stdlib / f"{name}.py").write_bytes(source(name))
    vals = val_names(2)
    for name in vals:
        (stdlib / f"{name}.py").write_bytes(source(name))
    (stdlib / "pkg" / "inner.py").write_bytes(source("inner"))
    (stdlib / "__pycache__").mkdir()
    (stdlib / "__pycache__" / "cached.py").write_bytes(source("cached"))
    (site / "thing").mkdir(parents=True)
    (site / "thing" / "a.py").write_bytes(source("sitea"))
    (site / "thing" / "same_as_a.py").write_bytes(source("sitea"))
    (site / "thing" / "copied_val.py").write_bytes(source(vals[0]))
    (site / "thing" / "huge.py").write_bytes(source("huge", lines=400))  # over the limit
    (site / "thing" / "notes.txt").write_bytes(source("notes"))
    os.symlink(site / "missing.py", site / "thing" / "broken.py")
    os.mkfifo(site / "thing" / "pipe.py")
    monkeypatch.setattr(corpus_mod, "MAX_SOURCE_BYTES", 8 << 10)
    monkeypatch.setattr(corpus_mod, "environment_roots", lambda: (stdlib, [site]))
    monkeypatch.setenv("LAB2_CACHE_DIR", str(tmp_path / "cache"))
    return stdlib, site, vals


def count(data: np.ndarray, text: str) -> int:
    return np.asarray(data).tobytes().count(text.encode())


def test_every_source_once_and_the_default_validation_split_held_out(fake_env, capsys):
    stdlib, site, vals = fake_env
    corpus = load_corpus(PYTHON_ENV)
    err = capsys.readouterr().err
    default = load_stdlib_corpus(root=stdlib)
    # The validation split is the default corpus's, bit for bit.
    assert np.array_equal(corpus.val, default.val)
    assert all(count(corpus.val, f"# {name}\n") == 40 for name in vals)
    train = corpus.train
    # Each training module once; the duplicate once; no validation content, not even copied.
    assert count(train, "# mod1\n") + count(train, "# mod2\n") >= 40
    assert count(train, "# sitea\n") == 40
    for name in vals:
        assert count(train, f"# {name}\n") == 0
    for left_out in ("huge", "notes", "cached"):
        assert count(train, f"# {left_out}\n") == 0
    # The default corpus's training files are all there, in its order of the folder.
    assert len(train) == len(default.train) + len(source("sitea"))
    assert "building the python-env corpus" in err
    assert ("1 duplicates, 3 copies of validation files, 1 over 8 KiB, 2 unreadable"
            in err), err
    assert corpus.is_bytes and corpus.vocab_size == 256
    assert corpus.source.startswith(f"{PYTHON_ENV}:")


def test_the_cache_is_memory_mapped_reused_and_rebuilt_when_damaged(fake_env, capsys,
                                                                  tmp_path):
    stdlib, site, _ = fake_env
    first = load_corpus(PYTHON_ENV)
    assert isinstance(first.train, np.memmap)
    capsys.readouterr()
    again = load_corpus(PYTHON_ENV)
    assert capsys.readouterr().err == ""  # read from the cache: nothing built, nothing said
    assert isinstance(again.train, np.memmap) and isinstance(again.val, np.memmap)
    assert again.identity() == first.identity()
    assert np.array_equal(again.train, first.train)
    [folder] = (tmp_path / "cache").glob(f"{PYTHON_ENV}-*")
    assert json.loads((folder / "checksums.json").read_text()).keys() == {"train.npy"}
    # One byte flipped in the cached array: named, rebuilt, the same array again (a copy:
    # the flip is written in place, so the maps above see it too).
    expected = np.array(first.train)
    path = folder / "train.npy"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    rebuilt = load_corpus(PYTHON_ENV)
    err = capsys.readouterr().err
    assert "is damaged (train.npy does not match its checksum); rebuilding it" in err
    assert np.array_equal(rebuilt.train, expected)
    # A package installed: another environment, another cache and identity.
    (site / "newpkg").mkdir()
    (site / "newpkg" / "__init__.py").write_bytes(source("newpkg"))
    changed = load_corpus(PYTHON_ENV)
    assert changed.identity() != first.identity()
    assert count(changed.train, "# newpkg\n") == 40


def test_built_in_memory_without_the_cache(fake_env):
    stdlib, site, _ = fake_env
    cached = load_corpus(PYTHON_ENV)
    alone = load_python_env_corpus(use_cache=False, roots=(stdlib, [site]))
    assert not isinstance(alone.train, np.memmap)
    assert np.array_equal(alone.train, cached.train) and np.array_equal(alone.val, cached.val)


def test_refusals(fake_env, tmp_path):
    with pytest.raises(DataError, match="python-env byte corpus has vocabulary 256"):
        load_corpus(PYTHON_ENV, vocab_size=1000)
    with pytest.raises(DataError, match="standard library directory not found"):
        load_python_env_corpus(roots=(tmp_path / "nowhere", []))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no Python source to train on"):
        load_python_env_corpus(use_cache=False, roots=(empty, []))


def test_the_sampler_holds_the_memory_map_and_resumes_the_same_batches(fake_env):
    built = load_corpus(PYTHON_ENV)
    straight = BatchSampler(built.train, 32, 8, seed=5)
    for _ in range(3):
        straight.next_global()
    state = straight.state_dict()
    expected = [straight.next_global() for _ in range(4)]
    # A new process: the corpus read back from the cache, the sampler from the state.
    cached = load_corpus(PYTHON_ENV)
    resumed = BatchSampler(cached.train, 32, 8, seed=5)
    resumed.load_state_dict(state)
    assert [a.tolist() for a in expected] == [resumed.next_global().tolist() for _ in range(4)]
    assert isinstance(resumed.tokens, np.memmap)
    assert Path(resumed.tokens.filename).name == "train.npy"


def tiny_settings(out: Path, **overrides) -> TrainSettings:
    model = ModelConfig(context_length=32, d_model=32, n_layers=2, n_heads=2, d_ff=64)
    fields = dict(model=model, data=PYTHON_ENV, steps=6, batch_size=8, lr=1e-2, min_lr=1e-3,
                  warmup=2, eval_every=0, eval_batches=2, out=str(out), sample_tokens=0,
                  quiet=True, plot=False, ddp="none", sharding="none", seed=0)
    fields.update(overrides)
    return TrainSettings(**fields).validate(1)


def test_a_run_on_python_env_resumes_bit_for_bit(fake_env, tmp_path):
    load_corpus(PYTHON_ENV)  # built before the ranks start, as lab2-train does
    straight = Trainer(tiny_settings(tmp_path / "a"), DistContext())
    assert isinstance(straight.sampler.tokens, np.memmap)
    straight.run()
    first = Trainer(tiny_settings(tmp_path / "b"), DistContext())
    first.run(stop_at=3)
    resumed = Trainer(tiny_settings(tmp_path / "b", resume=str(tmp_path / "b")), DistContext())
    assert resumed.step == 3 and isinstance(resumed.sampler.tokens, np.memmap)
    resumed.run()
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    ra = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").open()]
    rb = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").open()]
    assert [r["loss"] for r in ra] == [r["loss"] for r in rb]


SMALL = ["--preset", "tiny", "--batch-size", "8", "--eval-batches", "1", "--sample-tokens",
         "0", "--quiet", "--no-plot", "--nproc", "1", "--device", "cpu"]


def test_lab2_train_on_python_env_and_a_resume_in_a_changed_environment(fake_env, tmp_path,
                                                                       capsys):
    stdlib, site, _ = fake_env
    out = tmp_path / "run"
    assert main(["--data", PYTHON_ENV, "--steps", "2", "--out", str(out), *SMALL]) == 0
    assert 'data = "python-env"' in (out / "settings.toml").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["data"] == PYTHON_ENV
    capsys.readouterr()
    (site / "newpkg").mkdir()
    (site / "newpkg" / "__init__.py").write_bytes(source("newpkg"))
    assert main(["--resume", str(out), "--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint was trained on" in err and PYTHON_ENV in err
