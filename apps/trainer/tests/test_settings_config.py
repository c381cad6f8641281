"""One config source: flags built from the settings' fields, ``--config FILE.toml`` with
the flags over it, the ``settings.toml`` every run writes (and reruns from), and the
provenance summary.json records."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from lab2_trainer.cli.flags import field_docs, setting_fields
from lab2_trainer.cli.main import build_parser, main
from lab2_trainer.cli.settings_file import from_toml, to_toml
from lab2_trainer.config import ModelConfig, TrainSettings, flag

SMALL = ["--batch-size", "8", "--eval-batches", "1", "--sample-tokens", "0", "--quiet",
         "--no-plot", "--nproc", "1", "--device", "cpu"]


def test_every_setting_has_one_flag_with_its_fields_doc():
    parser = build_parser()
    by_dest = {a.dest: a for a in parser._actions}
    for cls, f in setting_fields():
        action = by_dest[f.name]
        assert action.option_strings[0] == flag(f.name)
        assert action.default is None  # a given value is told apart from the defaults
        doc = field_docs(cls)[f.name].replace("``", "")
        assert action.help.startswith(doc.replace("%", "%%")), f.name
        if f.metadata.get("choices"):
            assert list(action.choices) == list(f.metadata["choices"])
    documented = set(field_docs(TrainSettings)) | set(field_docs(ModelConfig))
    for cls in (TrainSettings, ModelConfig):
        assert {f.name for f in dataclasses.fields(cls)} <= documented


def test_resolve_fills_world_size_defaults():
    one = TrainSettings().resolve(None, "cuda")
    assert (one.nproc, one.ddp, one.sharding) == (1, "none", "none")
    # More ranks: zero1's ShardedOptimizer reduces the gradients itself, no DDP wrapper.
    two = TrainSettings().resolve(None, "cpu")
    assert (two.nproc, two.ddp, two.sharding) == (2, "none", "zero1")
    # A DDP wrapper given alone keeps its pairing with zero1's all-reduce + broadcast path.
    given = TrainSettings(nproc=3, ddp="torch").resolve(None, "cpu")
    assert (given.nproc, given.ddp, given.sharding) == (3, "torch", "zero1-allreduce")
    for kind in ("zero2", "fsdp"):
        alone = TrainSettings(nproc=2, sharding=kind).resolve(None, "cpu")
        assert (alone.ddp, alone.sharding) == ("none", kind)
    paired = TrainSettings(nproc=2, sharding="torch").resolve(None, "cpu")
    assert (paired.ddp, paired.sharding) == ("bucketed", "torch")
    assert TrainSettings(nproc=4).resolve(8, "cuda").nproc == 8  # torchrun's world wins
    with pytest.raises(ValueError, match="--nproc must be >= 1"):
        TrainSettings(nproc=0).resolve()


def test_toml_round_trip():
    s = TrainSettings(model=ModelConfig(eps=0.0, tie_embeddings=True), data='a "q"\\\x7f.txt',
                      lr=1e-5, clip=0.0, compile_mode="max-autotune", timeout=12.0)
    s.resolve(2, "cpu")
    train, model = from_toml(to_toml(s))
    assert model == s.model.to_dict()
    expected = {k: v for k, v in s.to_dict().items()
                if v is not None and k not in ("model", "resume", "device_type")}
    expected["device"] = "cpu"  # the device type it resolved to
    assert train == expected
    assert all(type(train[k]) is type(expected[k]) for k in expected)
    assert TrainSettings(model=ModelConfig(**model), **train).to_dict() == {
        **s.to_dict(), "device": "cpu"}


@pytest.mark.parametrize(("text", "fragment"), [
    ("steps = 0\n", "--steps must be >= 1"),
    ("stepz = 3\n", "unknown setting 'stepz'"),
    ("[model]\nwidth = 3\n", "unknown model setting 'width'"),
    ("lr = 'fast'\n", "lr must be of type float"),
    ("steps = [\n", "is not valid TOML"),
    ("eps = 1\n", "unknown setting 'eps'"),
    ("[model]\neps = -1.0\n", "eps must be a finite number >= 0"),
    ("clip = nan\n", "--clip must be a finite number"),
    ("preset = 'huge'\n", "unknown preset 'huge'"),
])
def test_bad_config_gives_one_line_and_writes_nothing(capsys, corpus_dir, tmp_path, text,
                                                      fragment):
    config = tmp_path / "c.toml"
    config.write_text(text)
    rc = main(["--config", str(config), "--data", str(corpus_dir), "--out",
               str(tmp_path / "o"), *SMALL])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("lab2-train: error: ")
    assert fragment in lines[0], lines[0]
    assert not (tmp_path / "o").exists()


def test_missing_config_file(capsys, tmp_path):
    rc = main(["--config", str(tmp_path / "none.toml")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "cannot read it" in lines[0]


def test_a_run_reruns_from_its_settings_toml(corpus_dir, tmp_path):
    """The tiny preset for 2 steps on the CPU; its settings.toml, given back with another
    --out, resolves to the same settings; a flag given with --config overrides it."""
    first = tmp_path / "first"
    assert main(["--preset", "tiny", "--steps", "2", "--data", str(corpus_dir), "--lr",
                 "2e-3", "--out", str(first), *SMALL]) == 0
    saved = first / "settings.toml"
    train, model = from_toml(saved.read_text())
    assert train["steps"] == 2 and train["lr"] == 2e-3 and model["n_layers"] == 3
    assert (train["nproc"], train["ddp"], train["sharding"], train["device"]) == (
        1, "none", "none", "cpu")
    summary = json.loads((first / "summary.json").read_text())
    assert set(summary["versions"]) >= {"lab2-trainer", "tritonnorm", "minddp", "zero1",
                                        "torch", "triton"}
    assert summary["versions"]["lab2-trainer"] and summary["versions"]["torch"]
    assert "git" in summary and (summary["git"] is None or len(summary["git"]["commit"]) == 40)

    second = tmp_path / "second"
    assert main(["--config", str(saved), "--out", str(second)]) == 0
    again = from_toml((second / "settings.toml").read_text())
    assert again == ({**train, "out": str(second)}, model)
    first_summary = summary["settings"]
    second_summary = json.loads((second / "summary.json").read_text())["settings"]
    assert {**first_summary, "out": None} == {**second_summary, "out": None}
    assert math.isclose(json.loads((second / "summary.json").read_text())["final_val_loss"],
                        summary["final_val_loss"], rel_tol=1e-6)

    third = tmp_path / "third"
    assert main(["--config", str(saved), "--out", str(third), "--steps", "1",
                 "--d-ff", "256"]) == 0
    train3, model3 = from_toml((third / "settings.toml").read_text())
    assert train3["steps"] == 1 and model3["d_ff"] == 256 and train3["lr"] == 2e-3


def test_settings_toml_does_not_exist_for_refused_runs(capsys, corpus_dir, tmp_path):
    out = tmp_path / "o"
    assert main(["--steps", "0", "--data", str(corpus_dir), "--out", str(out), *SMALL]) == 2
    assert not Path(out).exists()
