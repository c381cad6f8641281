"""``--precision`` and ``--compile`` left to the device (``auto``, their default): fp32 and
eager on the CPU, bf16 and regional compilation on a CUDA device with bf16 (faked here by
replacing torch's capability check), explicit values over both, chosen before any rank
starts, written to settings.toml as chosen, old settings and checkpoints as they were, a
resumed run as its checkpoint chose."""

from __future__ import annotations

import json

import pytest
import torch

from lab2_trainer.cli import checks
from lab2_trainer.cli.main import (
    build_parser,
    given_settings,
    main,
    resolve_settings,
    resumed_settings,
)
from lab2_trainer.cli.plan import build_parser as plan_parser
from lab2_trainer.cli.plan import plan_input
from lab2_trainer.cli.settings_file import from_toml, to_toml
from lab2_trainer.config import TrainSettings, UsageError
from lab2_trainer.reporting.report import precision_text


@pytest.fixture
def gpu(monkeypatch):
    """torch says there is a CUDA device, with bf16 unless ``gpu(bf16=False)``."""
    def fake(bf16: bool = True) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    fake()
    return fake


def resolved(argv: list[str], device_type: str, corpus_dir, tmp_path) -> TrainSettings:
    args = build_parser().parse_args(["--data", str(corpus_dir), "--out",
                                      str(tmp_path / "run"), "--nproc", "1", *argv])
    settings, _ = resolve_settings(given_settings(args), device_type)
    return settings


def chosen(s: TrainSettings) -> tuple:
    return s.precision, s.compile, s.compile_scope, s.auto


def test_the_capability_check():
    assert checks.bf16_supported("cpu") is False
    assert checks.bf16_supported("cuda") is bool(torch.cuda.is_available()
                                                 and torch.cuda.is_bf16_supported())


def test_auto_is_fp32_and_eager_on_the_cpu(corpus_dir, tmp_path):
    assert chosen(resolved([], "cpu", corpus_dir, tmp_path)) == (
        "fp32", False, "blocks", "precision,compile")
    # Settings made without the command line (a Trainer given them) run as on the CPU.
    assert chosen(TrainSettings()) == ("fp32", False, "blocks", "precision,compile")
    assert chosen(TrainSettings().validate(1)) == ("fp32", False, "blocks",
                                                   "precision,compile")


def test_auto_is_bf16_and_regional_compilation_on_a_cuda_device_with_bf16(
        gpu, corpus_dir, tmp_path):
    assert checks.bf16_supported("cuda") and not checks.bf16_supported("cpu")
    assert chosen(resolved([], "cuda", corpus_dir, tmp_path)) == (
        "bf16", True, "blocks", "precision,compile")
    assert chosen(resolved(["--compile", "auto", "--precision", "auto"], "cuda", corpus_dir,
                           tmp_path)) == ("bf16", True, "blocks", "precision,compile")
    gpu(bf16=False)  # an older GPU: as on the CPU
    assert chosen(resolved([], "cuda", corpus_dir, tmp_path)) == (
        "fp32", False, "blocks", "precision,compile")


@pytest.mark.parametrize(("argv", "expected"), [
    (["--precision", "fp16", "--no-compile"], ("fp16", False, "blocks", "")),
    (["--precision", "fp32"], ("fp32", True, "blocks", "compile")),
    (["--compile", "off"], ("bf16", False, "blocks", "precision")),
    (["--compile-scope", "model"], ("bf16", True, "model", "precision,compile")),
])
def test_given_values_win_on_the_gpu(gpu, corpus_dir, tmp_path, argv, expected):
    assert chosen(resolved(argv, "cuda", corpus_dir, tmp_path)) == expected


@pytest.mark.parametrize(("argv", "expected"), [
    (["--precision", "bf16", "--compile"], ("bf16", True, "blocks", "")),
    (["--compile", "on"], ("fp32", True, "blocks", "precision")),
    (["--compile"], ("fp32", True, "blocks", "precision")),
])
def test_given_values_win_on_the_cpu(corpus_dir, tmp_path, argv, expected):
    assert chosen(resolved(argv, "cpu", corpus_dir, tmp_path)) == expected


def test_the_flag_spellings():
    parse = build_parser().parse_args
    assert [parse(a).compile for a in ([], ["--compile"], ["--no-compile"], ["--compile=on"],
                                       ["--compile", "off"], ["--compile", "auto"])] == [
        None, True, False, True, False, "auto"]
    for bad in (["--compile", "maybe"], ["--no-compile", "on"]):
        with pytest.raises(UsageError):
            parse(bad)


def test_settings_toml_holds_the_chosen_values_and_a_rerun_chooses_again(
        gpu, corpus_dir, tmp_path):
    s = resolved([], "cuda", corpus_dir, tmp_path)
    text = to_toml(s)
    assert 'precision = "bf16"' in text and "compile = true" in text
    assert 'auto = "precision,compile"' in text
    train, _ = from_toml(text)
    again = TrainSettings(**train)
    assert chosen(again) == ("bf16", True, "blocks", "precision,compile")
    # The same file rerun where there is no GPU: chosen afresh for the CPU.
    assert chosen(again.resolve(1, "cpu", bf16=False)) == ("fp32", False, "blocks",
                                                           "precision,compile")
    # A flag given over the file takes that setting from the device.
    config = tmp_path / "settings.toml"
    config.write_text(text)
    args = build_parser().parse_args(["--config", str(config), "--precision", "fp16"])
    train, _ = given_settings(args)
    assert train["precision"] == "fp16" and train["auto"] == "compile"
    assert from_toml('compile = "auto"\n')[0] == {"compile": None}


def test_old_settings_files_and_checkpoints_keep_their_values(gpu):
    # settings.toml of a version before auto: its values are given values.
    train, _ = from_toml('precision = "fp32"\ncompile = false\nsteps = 3\n')
    s = TrainSettings(**train).resolve(1, "cuda", bf16=True)
    assert chosen(s) == ("fp32", False, "blocks", "")
    # A checkpoint's settings of a version before auto (no "auto" key).
    old = TrainSettings(precision="bf16", compile=True).to_dict()
    del old["auto"]
    loaded = TrainSettings.from_dict(old).resolve(1, "cpu", bf16=False)
    assert chosen(loaded) == ("bf16", True, "blocks", "")


def test_a_resumed_run_keeps_what_its_checkpoint_chose():
    saved = TrainSettings(nproc=1).resolve(1, "cuda", bf16=True)
    assert chosen(saved) == ("bf16", True, "blocks", "precision,compile")
    keep = resumed_settings(saved, {}, "cpu", None)
    assert keep["auto"] == "precision,compile"  # its settings.toml stays the same
    resumed = TrainSettings(model=saved.model, **keep).resolve(None, "cpu")
    assert chosen(resumed) == ("bf16", True, "blocks", "precision,compile")
    # One given is no longer the device's.
    keep = resumed_settings(saved, {"precision": "fp32"}, "cpu", None)
    assert (keep["precision"], keep["compile"], keep["auto"]) == ("fp32", True, "compile")


SMALL = ["--batch-size", "8", "--eval-batches", "1", "--sample-tokens", "0", "--quiet",
         "--no-plot", "--nproc", "1", "--device", "cpu"]


def test_a_resume_on_a_gpu_keeps_the_cpus_choice_unless_asked_again(monkeypatch, corpus_dir,
                                                                    tmp_path):
    out = tmp_path / "run"
    assert main(["--data", str(corpus_dir), "--out", str(out), "--steps", "1", *SMALL]) == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # then a GPU with bf16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)

    def resume(*flags: str) -> TrainSettings:
        args = build_parser().parse_args(["--resume", str(out), "--steps", "2", "--device",
                                          "cuda", *flags])
        settings, _ = resolve_settings(given_settings(args), "cuda")
        return settings

    assert chosen(resume()) == ("fp32", False, "blocks", "precision,compile")
    assert chosen(resume("--precision", "auto")) == ("bf16", False, "blocks",
                                                     "precision,compile")
    assert chosen(resume("--compile", "auto")) == ("fp32", True, "blocks", "precision,compile")
    assert chosen(resume("--precision", "fp16")) == ("fp16", False, "blocks", "compile")


def test_the_run_says_what_the_device_chose(corpus_dir, tmp_path, capsys):
    assert precision_text({"precision": "bf16", "compile": True, "compile_scope": "blocks",
                           "auto": "precision,compile"}) == "bf16 (auto), compile blocks (auto)"
    assert precision_text({"precision": "fp16", "compile": False, "auto": ""}) == (
        "fp16, no compile")
    out = tmp_path / "run"
    assert main(["--data", str(corpus_dir), "--out", str(out), "--steps", "1", *SMALL]) == 0
    assert "fp32 (auto), no compile (auto)" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["auto"] == "precision,compile"
    train, _ = from_toml((out / "settings.toml").read_text())
    assert (train["precision"], train["compile"], train["auto"]) == (
        "fp32", False, "precision,compile")


def test_the_planner_plans_what_a_gpu_chooses():
    p = plan_input(plan_parser().parse_args(["--preset", "small"]))
    assert (p.precision, p.compile) == ("bf16", True)
    p = plan_input(plan_parser().parse_args(["--preset", "small", "--precision", "fp32",
                                             "--no-compile"]))
    assert (p.precision, p.compile) == ("fp32", False)
