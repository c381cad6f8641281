"""``--optimizer muon`` in one process: which parameters Muon steps, the joint optimizer
(learning rates, clipping, state dicts) against zero1.Muon and AdamW stepped by hand in
float64, the settings and their file, the command line's runs and resumes through its
checks, and every refusal (exit code 2, one line, nothing written)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import zero1
from lab2_testing.cli import folder_listing, one_error_line, refused_here
from lab2_trainer.checkpoint.compat import check_checkpoint_fits
from lab2_trainer.checkpoint.export import export
from lab2_trainer.cli.main import main
from lab2_trainer.cli.settings_file import from_toml, to_toml
from lab2_trainer.config import ModelConfig, TrainSettings, UsageError, model_config
from lab2_trainer.models.transformer import TransformerLM
from lab2_trainer.parallel.optimizers import (
    MuonSettings,
    MuonWithAdamW,
    muon_param_groups,
    optimizer_order,
    split_state_dict,
)
from lab2_trainer.parallel.parallelize import parallelize
from lab2_trainer.recipe.muon import MUON_LR, muon_problem
from lab2_trainer.training.step import set_lr, train_step

torch.set_num_threads(1)

TINY = ["--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--d-ff", "64",
        "--context-length", "32", "--batch-size", "8", "--eval-batches", "1",
        "--eval-every", "0", "--sample-tokens", "0", "--quiet", "--no-plot", "--device", "cpu"]
CMD = [sys.executable, "-c", "import sys; from lab2_trainer.cli.main import main; sys.exit(main())"]


@pytest.mark.parametrize("fields", [
    dict(),
    dict(ffn="gelu", tie_embeddings=True, norm="layernorm"),
    dict(rope=True, ffn="relu2"),
], ids=["swiglu", "gelu-tied-layernorm", "rope-relu2"])
def test_muon_takes_the_blocks_matrices_and_adamw_everything_else(fields):
    model = TransformerLM(ModelConfig(d_model=16, n_layers=2, n_heads=2, d_ff=32, **fields),
                          seed=0)
    names = {id(p): n for n, p in model.named_parameters()}
    adamw, muon = muon_param_groups(model, 0.1)
    muon_names = [names[id(p)] for p in muon[0]["params"]]
    per_block = ("attn.qkv.weight", "attn.proj.weight", "ffn.w1.weight", "ffn.w2.weight",
                 *(("ffn.w3.weight",) if model.config.ffn == "swiglu" else ()))
    assert muon_names == [f"blocks.{i}.{n}" for i in range(2) for n in per_block]
    assert muon[0]["weight_decay"] == 0.1
    # AdamW: the head decays (none when tied to the table); norms and tables do not.
    assert [names[id(p)] for p in adamw[0]["params"]] == (
        [] if fields.get("tie_embeddings") else ["lm_head.weight"])
    assert adamw[0]["weight_decay"] == 0.1 and adamw[1]["weight_decay"] == 0.0
    assert all(p.dim() == 1 or names[id(p)].endswith("emb.weight")
               for p in adamw[1]["params"])
    # Every parameter once, in the order the state dict numbers them.
    order = optimizer_order(model, 0.1, "muon")
    assert [id(p) for p in order] == [id(p) for g in adamw + muon for p in g["params"]]
    assert sorted(map(id, order)) == sorted(map(id, model.parameters()))
    assert len(optimizer_order(model, 0.1)) == len(order)  # AdamW alone: the same set


def _float64_run(clip: float, by_hand: bool) -> tuple[list[float], dict]:
    """Three steps of the trainer's one-process Muon with AdamW (or the same written out
    with zero1.Muon and AdamW stepped by hand), the learning rate set every step."""
    model = TransformerLM(ModelConfig(d_model=16, n_layers=2, n_heads=2, d_ff=32,
                                      context_length=8, vocab_size=32), seed=0).double()
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 32, (3, 4, 9), generator=gen)
    norms = []
    if by_hand:
        adamw_groups, muon_groups = muon_param_groups(model, 0.1)
        adamw = torch.optim.AdamW(adamw_groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
        muon = zero1.Muon(muon_groups, lr=0.05, ns_dtype=None)
        for step, window in enumerate(data):
            _, loss = model(window[:, :-1], window[:, 1:])
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(list(model.parameters()),
                                                              clip or float("inf"))))
            for group in adamw.param_groups:
                group["lr"] = 1e-2 / (step + 1)
            for group in muon.param_groups:
                group["lr"] = 0.05 / (step + 1)
            adamw.step()
            muon.step()
            adamw.zero_grad()
            muon.zero_grad()
        return norms, model.state_dict()
    parallel = parallelize(model, sharding="none", ddp="none", device=torch.device("cpu"),
                           lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1,
                           muon=MuonSettings(0.05, ns_dtype=None))
    assert isinstance(parallel.optimizer, MuonWithAdamW)
    for step, window in enumerate(data):
        set_lr(parallel.optimizer, 1e-2 / (step + 1))
        _, norm = train_step(parallel, [(window[:, :-1], window[:, 1:])], precision="fp32",
                             device=torch.device("cpu"), clip=clip)
        norms.append(float(norm))
    return norms, model.state_dict()


@pytest.mark.parametrize("clip", [0.0, 0.1])
def test_the_joint_optimizer_is_muon_and_adamw_stepped_by_hand(clip):
    norms, state = _float64_run(clip, by_hand=False)
    want_norms, want = _float64_run(clip, by_hand=True)
    assert norms == pytest.approx(want_norms, rel=1e-13)
    for name, value in want.items():
        error = (state[name] - value).norm() / value.norm()
        assert error < 1e-13, name


def test_state_dicts_split_and_join_and_refuse_adamws_alone():
    model = TransformerLM(ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32), seed=0)
    adamw_groups, muon_groups = muon_param_groups(model, 0.1)
    joint = MuonWithAdamW(torch.optim.AdamW(adamw_groups, lr=1e-3),
                          zero1.Muon(muon_groups, lr=0.02), lr_ratio=20.0)
    set_lr(joint, 5e-4)
    assert [g["lr"] for g in joint.param_groups] == [5e-4, 5e-4, pytest.approx(1e-2)]
    _, loss = model(torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long))
    loss.backward()
    joint.step()
    sd = joint.state_dict()
    first, second = split_state_dict(sd, 2)
    assert [len(g["params"]) for g in second["param_groups"]] == [5]
    assert sorted(second["state"]) == list(range(5))
    assert all(e.keys() == {"momentum_buffer"} for e in second["state"].values())
    assert all(e.keys() == {"exp_avg", "exp_avg_sq", "step"} for e in first["state"].values())
    # Loaded into a fresh pair, the state dict comes back the same.
    fresh_groups = muon_param_groups(TransformerLM(model.config, seed=1), 0.1)
    fresh = MuonWithAdamW(torch.optim.AdamW(fresh_groups[0], lr=1e-3),
                          zero1.Muon(fresh_groups[1], lr=0.02), lr_ratio=20.0)
    fresh.load_state_dict(sd)
    again = fresh.state_dict()
    assert again["param_groups"] == sd["param_groups"]
    for i, entry in sd["state"].items():
        for key, value in entry.items():
            assert torch.equal(again["state"][i][key], value)
    with pytest.raises(ValueError, match="AdamW's alone"):
        split_state_dict({"state": {}, "param_groups": sd["param_groups"][:2]}, 2)


def test_settings_fill_muons_rate_and_keep_it_in_settings_toml():
    s = TrainSettings(model=model_config("tiny"), optimizer="muon").resolve(2)
    assert s.muon_lr == MUON_LR
    s.validate(2)
    assert TrainSettings(model=model_config("tiny")).resolve(2).muon_lr is None  # AdamW
    text = to_toml(s)
    assert 'optimizer = "muon"' in text and f"muon_lr = {MUON_LR!r}" in text
    train, _ = from_toml(text)
    assert train["optimizer"] == "muon" and train["muon_lr"] == MUON_LR
    # Older checkpoints and settings files lack the fields: AdamW.
    assert TrainSettings.from_dict({"model": model_config("tiny").to_dict()}).optimizer \
        == "adamw"
    assert muon_problem("adamw", "fsdp", 4) is None
    assert muon_problem("muon", "zero3", 1) is None


def test_fsdp_is_refused_by_the_real_command(tmp_path):
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    before = folder_listing(tmp_path)
    proc = subprocess.run([*CMD, *TINY, "--steps", "2", "--optimizer", "muon",
                           "--sharding", "fsdp"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=180)
    one_error_line(proc.returncode, proc.stderr,
                   ("--optimizer muon cannot run with --sharding fsdp", "--sharding zero3"))
    assert folder_listing(tmp_path) == before


@pytest.mark.parametrize(("extra", "fragments"), [
    (["--tp", "2", "--nproc", "2"], ("--optimizer muon cannot run with --tp 2",)),
    (["--sharding", "fsdp", "--nproc", "1"], ("--sharding fsdp",)),
    (["--muon-lr", "0"], ("--muon-lr must be > 0",)),
    (["--muon-lr", "nan"], ("--muon-lr must be a finite number",)),
], ids=["tp", "fsdp-one-rank", "zero-rate", "nan-rate"])
def test_what_muon_cannot_do_is_refused_before_any_rank_starts(capsys, monkeypatch, tmp_path,
                                                               extra, fragments):
    refused_here(capsys, monkeypatch, [*TINY, "--steps", "2", "--optimizer", "muon", *extra],
                 tmp_path / "case", *fragments)


@pytest.fixture(scope="module")
def runs(corpus_dir, tmp_path_factory):
    """An AdamW run and a Muon run of 2 steps (the one-process path of the command), each
    ending with a sharded checkpoint."""
    root = tmp_path_factory.mktemp("muon-runs")
    for kind in ("adamw", "muon"):
        rc = main([*TINY, "--data", str(corpus_dir), "--nproc", "1", "--steps", "2",
                   "--optimizer", kind, "--out", str(root / kind)])
        assert rc == 0
    return root


def test_a_muon_run_resumes_through_the_commands_checks(runs, corpus_dir, tmp_path):
    """The sharded checkpoint and its export both pass the checks before the ranks start
    (Muon's part of the state against zero1.Muon's), and resume to the same weights."""
    summary = json.loads((runs / "muon" / "summary.json").read_text())
    assert "zero1.Muon + AdamW" in summary["setup"]
    assert summary["settings"]["muon_lr"] == MUON_LR
    export(runs / "muon", tmp_path / "muon.pt")
    finals = []
    for source, out in ((runs / "muon", tmp_path / "a"), (tmp_path / "muon.pt", tmp_path / "b")):
        rc = main(["--data", str(corpus_dir), "--resume", str(source), "--steps", "4",
                   "--out", str(out)])
        assert rc == 0
        finals.append(json.loads((out / "summary.json").read_text())["final_val_loss"])
        assert json.loads((out / "summary.json").read_text())["settings"]["optimizer"] == "muon"
    assert finals[0] == pytest.approx(finals[1], rel=1e-6)


@pytest.mark.parametrize(("run", "flag"), [("adamw", "muon"), ("muon", "adamw")])
def test_a_resume_that_changes_the_optimizer_is_refused(capsys, monkeypatch, runs, corpus_dir,
                                                        tmp_path, run, flag):
    refused_here(capsys, monkeypatch, ["--data", str(corpus_dir), "--resume", str(runs / run),
                                       "--steps", "4", "--optimizer", flag],
                 tmp_path / "case", f"was trained with --optimizer '{run}'",
                 "drop --optimizer")


@pytest.mark.parametrize("damage", ["shape", "adamw-state", "momentum", "one-group"])
def test_a_muon_state_that_does_not_fit_is_refused_in_one_line(runs, tmp_path, damage):
    """The checks of a single-file checkpoint (``--resume`` runs them before any rank
    starts) on Muon's part of the state."""
    export(runs / "muon", tmp_path / "muon.pt")
    ckpt = torch.load(tmp_path / "muon.pt", weights_only=True)
    settings = TrainSettings.from_dict(ckpt["settings"])
    settings.model = ModelConfig.from_dict(ckpt["model_config"])
    check_checkpoint_fits(ckpt, settings, "ckpt")  # as it is: fits
    groups, state = ckpt["optimizer"]["param_groups"], ckpt["optimizer"]["state"]
    first = state[groups[2]["params"][0]]
    if damage == "shape":
        first["momentum_buffer"] = first["momentum_buffer"][:1]
        fragment = "momentum_buffer"
    elif damage == "adamw-state":
        state[groups[2]["params"][0]] = state[groups[1]["params"][0]]
        fragment = "optimizer state"
    elif damage == "momentum":
        groups[2]["momentum"] = 1.5
        fragment = "momentum must be a number in [0, 1)"
    else:
        del groups[2]
        fragment = "AdamW's alone"
    with pytest.raises(UsageError, match="checkpoint ckpt") as info:
        check_checkpoint_fits(ckpt, settings, "ckpt")
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_the_planner_counts_one_momentum_buffer_for_muons_matrices():
    """The planner's optimizer bytes with Muon against the state a real step leaves (one
    process), and sharded as the kinds shard it; fsdp and tensor parallelism refused."""
    from lab2_trainer.models.shapes import muon_parameter_count, training_state_parts
    from lab2_trainer.planner.plan import PlanInput, memory_items

    config = ModelConfig(d_model=16, n_layers=2, n_heads=2, d_ff=32, context_length=8)
    model = TransformerLM(config, seed=0)
    parallel = parallelize(model, sharding="none", ddp="none", device=torch.device("cpu"),
                           lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
                           muon=MuonSettings(0.02))
    train_step(parallel, [(torch.zeros(2, 8, dtype=torch.long),) * 2], precision="fp32",
               device=torch.device("cpu"), clip=1.0)
    held = sum(t.numel() * t.element_size() for entry in parallel.optimizer.state.values()
               for key, t in entry.items() if key != "step")  # AdamW's scalar steps aside
    n = sum(p.numel() for p in model.parameters())
    assert held == training_state_parts(n, "none", 1, muon=muon_parameter_count(config))[
        "optimizer"]
    assert muon_parameter_count(config) == sum(
        p.numel() for g in parallel.optimizer.muon.param_groups for p in g["params"])
    small = model_config("small")
    for sharding, gpus in (("none", 1), ("zero1", 8), ("zero2", 8), ("zero3", 8)):
        plans = [memory_items(PlanInput(model=small, batch_size=8 * gpus, gpus_per_node=gpus,
                                        sharding=sharding, optimizer=kind).validate())
                 for kind in ("adamw", "muon")]
        saved = plans[0]["optimizer"] - plans[1]["optimizer"]
        assert saved == pytest.approx(4 * muon_parameter_count(small) / gpus, abs=4), sharding
    for sharding, tp in (("fsdp", 1), ("zero1", 2)):
        with pytest.raises(ValueError, match="--optimizer muon cannot run"):
            PlanInput(model=small, batch_size=16, gpus_per_node=8, sharding=sharding, tp=tp,
                      optimizer="muon").validate()


def test_tiny_trains_with_muon_unless_the_layout_cuts_its_matrices(tmp_path):
    """Every run takes Muon as the recipe's default (recipe.defaults); a flag wins, and
    --sharding fsdp or --tp > 1 leave it AdamW instead of refusing."""
    from lab2_trainer.cli.main import build_parser, given_settings, resolve_settings

    def new_run(argv):
        args = build_parser().parse_args([*argv, "--out", str(tmp_path / "run")])
        return resolve_settings(given_settings(args), "cpu")[0]

    tiny = new_run(["--nproc", "2"])
    assert (tiny.optimizer, tiny.muon_lr, tiny.sharding) == ("muon", MUON_LR, "zero1")
    assert new_run(["--nproc", "2", "--optimizer", "adamw"]).optimizer == "adamw"
    for argv in (["--nproc", "2", "--sharding", "fsdp"], ["--nproc", "2", "--tp", "2"]):
        run = new_run(argv)
        assert (run.optimizer, run.muon_lr) == ("adamw", None), argv
    # Muon is the recipe's for every model: a reshaped tiny and the other presets take it.
    assert new_run(["--nproc", "2", "--d-model", "64"]).optimizer == "muon"
    assert new_run(["--nproc", "1", "--preset", "small"]).optimizer == "muon"
