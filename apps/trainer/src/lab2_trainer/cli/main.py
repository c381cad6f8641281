"""``lab2-train``: train the Transformer LM.

With no arguments it trains the ``tiny`` preset on the standard library's sources with 2
local ranks on the CPU (Gloo, minddp's DDPBucketed, zero1's ShardedOptimizer), or 1 rank on
a GPU. Everything is checked here, before any rank starts, so that bad input costs one
line on stderr and exit code 2, and no file is written.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import fields
from datetime import timedelta
from pathlib import Path
from typing import Any

from lab2_trainer import __version__
from lab2_trainer.cli.flags import GROUPS, add_setting_flag, setting_fields
from lab2_trainer.cli.settings_file import from_toml
from lab2_trainer.config import (
    AUTO,
    AUTO_SETTINGS,
    EXIT_BAD_INPUT,
    PRESETS,
    ModelConfig,
    TrainSettings,
    UsageError,
    flag,
    model_config,
)
from lab2_trainer.recipe.defaults import preset_run
from lab2_trainer.recipe.layout import default_layout

EXIT_OK, EXIT_FAILED = 0, 1
SETTINGS_NAME = "settings.toml"


class _Parser(argparse.ArgumentParser):
    """argparse, except that a bad command line is one line naming the flag (a
    :class:`UsageError`), not the usage text: ``--help`` prints that."""

    def error(self, message: str) -> None:  # type: ignore[override]
        text = " ".join(message.split())
        raise UsageError(f"{text} (lab2-train --help lists the options)")


def build_parser() -> argparse.ArgumentParser:
    """The command line, one flag per setting field (its type, choices and doc); every
    default is None so that a given value can be told apart from the file's or the
    field's default. A bad command line raises :class:`UsageError`."""
    p = _Parser(
        prog="lab2-train",
        description="Train a decoder-only Transformer LM on tritonnorm, minddp and zero1.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--config", metavar="FILE.toml",
                   help=f"read settings from a TOML file (a run folder's {SETTINGS_NAME} "
                   "reruns that run); the flags given override it")
    groups = {name: p.add_argument_group(name) for name in GROUPS}
    groups["model"].add_argument("--preset", choices=list(PRESETS),
                                 help="size preset (default tiny)")
    for cls, f in setting_fields():
        add_setting_flag(groups[f.metadata["group"]], cls, f)
    return p


def given_settings(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The settings given: ``--config``'s file, then the flags over it.

    Returns:
        (run settings, model fields), only the keys given; ``preset`` among the first.

    Raises:
        UsageError: an unreadable or invalid ``--config`` file.
    """
    train: dict[str, Any] = {}
    model: dict[str, Any] = {}
    if args.config is not None:
        from lab2_trainer.runtime.paths import read_bounded_text, shown

        source = f"--config {shown(args.config)}"
        text = read_bounded_text(args.config, "--config")  # never a FIFO or /dev/zero
        try:
            train, model = from_toml(text, source)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if "vocab_size" in train:
            model.setdefault("vocab_size", train["vocab_size"])
    if args.preset is not None:
        train["preset"] = args.preset
    if train.get("preset", "tiny") not in PRESETS:
        raise UsageError(f"--config {args.config}: unknown preset {train['preset']!r}; choose "
                         f"one of {', '.join(PRESETS)}")
    for cls, f in setting_fields():
        value = getattr(args, f.name, None)
        if value is None:
            continue
        if f.name in AUTO_SETTINGS:
            if "auto" in train:  # given here: the file's choice for the device gives way
                listed = str(train["auto"]).split(",")
                train["auto"] = ",".join(n for n in listed if n and n != f.name)
            if value == AUTO and f.name == "compile":
                value = None  # left to the device
        if cls is ModelConfig:
            model[f.name] = value
            if f.name == "vocab_size":  # --vocab-size: the data's vocabulary, too
                train[f.name] = value
        else:
            train[f.name] = value
    return train, model


def _newest_run_checkpoint(root: Path = Path("runs")) -> Path:
    """The newest checkpoint of any run under ``root``: its newest complete step folder
    (or a single ``ckpt.pt`` of an earlier version)."""
    from lab2_trainer.checkpoint.folders import CKPT_DIR, MANIFEST, newest_step
    from lab2_trainer.checkpoint.single_file import CHECKPOINT_NAME

    found = [p for p in (newest_step(run / CKPT_DIR) for run in root.glob("*")
                         if run.is_dir()) if p is not None]
    found += list(root.glob(f"*/{CHECKPOINT_NAME}"))
    if not found:
        raise UsageError(f"--resume without a path: no {root}/*/{CKPT_DIR}/step-N/{MANIFEST} "
                         f"nor {root}/*/{CHECKPOINT_NAME} found")
    mtime = {p: (p / MANIFEST if p.is_dir() else p).stat().st_mtime for p in found}
    return max(found, key=mtime.get)


def load_resume_state(path: Path) -> dict[str, Any]:
    """The checkpoint ``--resume`` resolved to, checked: a single file read whole, or a
    step folder's every file checked against its manifest and its small state read (its
    tensors are read a few at a time, to check that they are finite: the ranks then read
    their parts)."""
    from lab2_trainer.checkpoint.folders import first_non_finite, load_trainer_state, verify
    from lab2_trainer.checkpoint.single_file import load_checkpoint

    if path.is_file():
        return load_checkpoint(path)
    verify(path)
    state = load_trainer_state(path)
    bad = first_non_finite(path)
    if bad:
        raise UsageError(f"checkpoint {path} is unusable: {bad}")
    return state


def run_folder_of(path: Path) -> Path:
    """The run folder a checkpoint belongs to: a file's folder, a step folder's run."""
    from lab2_trainer.checkpoint.folders import CKPT_DIR

    if path.is_dir() and path.parent.name == CKPT_DIR:
        return path.parent.parent
    return path.parent


def _torchrun_world() -> int | None:
    from lab2_trainer.runtime.launch import launched_by_torchrun

    return int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else None


def resolve_settings(given: tuple[dict[str, Any], dict[str, Any]], device_type: str,
                     torchrun_world: int | None = None, notes: list[str] | None = None):
    """Turn the settings given (:func:`given_settings`) and a checkpoint, when resuming,
    into resolved, checked settings for ``device_type``.

    Args:
        notes: where to add what the run should say before it starts (a resumed run whose
            sharding or DDP kind is chosen afresh for a new rank layout).

    Returns:
        (settings, corpus) with the corpus loaded once here, which also checks the data
        and warms its cache before the ranks start.
    """
    from lab2_trainer.checkpoint.compat import check_checkpoint_fits, check_sharded_checkpoint_fits
    from lab2_trainer.checkpoint.folders import has_checkpoint
    from lab2_trainer.checkpoint.folders import resolve as resolve_checkpoint
    from lab2_trainer.cli.checks import bf16_supported, check_compile, check_fp8, check_memory
    from lab2_trainer.data.batches import check_batch_layout
    from lab2_trainer.data.corpus import load_corpus
    from lab2_trainer.runtime.paths import check_input_path, check_out_path, check_path_length

    explicit, model_overrides = dict(given[0]), dict(given[1])
    preset = explicit.pop("preset", None)
    out = explicit.pop("out", None)
    resume = explicit.pop("resume", None)
    ckpt = None
    if out == "":
        raise UsageError("--out is empty: name a folder (or leave --out out for "
                         "runs/<preset>-<time>)")
    if out is not None:
        check_path_length(out, "--out")
    if resume is not None:
        if resume:
            check_input_path(resume, "--resume", missing="checkpoint not found")
            path = resolve_checkpoint(resume)
        elif out:
            path = resolve_checkpoint(out)
        else:
            path = _newest_run_checkpoint()
        ckpt = load_resume_state(path)
        try:
            saved = TrainSettings.from_dict(ckpt["settings"])
            saved_model = ModelConfig.from_dict(ckpt["model_config"])
        except (KeyError, TypeError, ValueError) as exc:
            raise UsageError(f"checkpoint {path} has unusable settings: {exc}") from None
        if preset is not None:
            model_overrides = {**PRESETS[preset], **model_overrides}
        for name, value in model_overrides.items():
            if getattr(saved_model, name) != value:
                raise UsageError(
                    f"checkpoint {path} is incompatible: its model has {name}="
                    f"{getattr(saved_model, name)!r}, the command line asks for {value!r}"
                )
        refuse_math_changes(saved, explicit, path)
        if "device" not in explicit and saved.device != "auto":
            device_type = _device_type(saved.device)
        keep = resumed_settings(saved, explicit, device_type, torchrun_world)
        settings = TrainSettings(model=saved_model, **keep)
        settings.out = out or str(run_folder_of(path))
        settings.resume = str(path)
    else:
        # A preset's own run defaults (lab2_trainer.recipe.defaults.PRESET_RUNS), under what is
        # given.
        explicit = {**preset_run(preset or "tiny", model_overrides, explicit), **explicit}
        try:
            model = model_config(preset or "tiny", **model_overrides)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        try:
            settings = TrainSettings(model=model, **explicit)
        except TypeError as exc:
            raise UsageError(str(exc)) from None
        stamp = time.strftime("%Y%m%d-%H%M%S")
        settings.out = out or os.path.join("runs", f"{preset or 'tiny'}-{stamp}")
        if has_checkpoint(settings.out):
            from lab2_trainer.runtime.run_folder import in_use_message, live_claim

            owner = live_claim(settings.out)
            if owner is not None:
                raise UsageError(in_use_message(settings.out, owner))
            raise UsageError(f"{settings.out} holds a checkpoint: pass --resume to continue "
                             "that run, or choose another --out (nothing was overwritten)")
    try:
        # The defaults that depend on the device and the ranks: nproc, ddp, sharding; and
        # the settings left to the device (precision, compile), of which a resumed run
        # chooses again only those given as "auto" (it keeps its checkpoint's others).
        again = [n for n in AUTO_SETTINGS if n in explicit and explicit[n] in (AUTO, None)]
        world_size = settings.resolve(torchrun_world, device_type).nproc
        settings.choose_for_device(bf16_supported(device_type),
                                   again if ckpt is not None else AUTO_SETTINGS)
        settings.validate(world_size)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if ckpt is not None and notes is not None:
        notes += layout_notes(saved, settings, explicit, path)
    check_out_path(settings.out)
    check_memory(settings, world_size, device_type)
    if settings.compile:
        check_compile(settings.compile_backend, settings.compile_mode)
    check_batch_layout(settings.batch_size, settings.data_parallel_size(world_size),
                       settings.grad_accum)
    check_fp8(settings, world_size, device_type)
    corpus = load_corpus(settings.data, settings.vocab_size, settings.stdlib_share)
    if corpus.vocab_size != settings.model.vocab_size:
        raise UsageError(f"the data has vocabulary {corpus.vocab_size}, the model "
                         f"{settings.model.vocab_size}: pass --vocab-size")
    need = settings.model.context_length + 1
    for split, tokens in (("train", corpus.train), ("validation", corpus.val)):
        if len(tokens) < need:
            raise UsageError(f"the {split} split of {corpus.source} has {len(tokens)} tokens, "
                             f"fewer than one window of context_length + 1 = {need}")
    if ckpt is not None and ckpt["data"] != corpus.identity():
        raise UsageError(f"checkpoint was trained on {ckpt['data']}, not on {corpus.identity()}")
    if ckpt is not None and ckpt.get("sharded"):
        from lab2_trainer.checkpoint.parts import saved_tensors

        check_sharded_checkpoint_fits(ckpt, saved_tensors(path), settings, path)
    elif ckpt is not None:
        check_checkpoint_fits(ckpt, settings, path)
    if ckpt is not None and settings.steps <= ckpt["step"]:
        where = (f"--steps {settings.steps} is not beyond it" if "steps" in explicit
                 else f"the end of its run (steps = {settings.steps})")
        raise UsageError(f"checkpoint {path} is at step {ckpt['step']}, {where}: nothing "
                         f"to train (pass --steps N with N > {ckpt['step']} to extend it)")
    return settings, corpus


#: What a resumed run may not change: the optimizer's state carries these (a flag would be
#: overridden by the checkpoint's optimizer state while settings.toml said otherwise), and
#: its kind (AdamW's moments or Muon's momentum).
FIXED_ON_RESUME = ("beta1", "beta2", "weight_decay", "optimizer")
#: How the ranks are laid out: kept together from the checkpoint, or (any of them given, or
#: another device type or torchrun's world) resolved afresh for the new layout.
LAYOUT_FIELDS = ("nproc", "ddp", "sharding")
#: Never taken from the checkpoint: where the run goes and what it resumes are this
#: command's; the device type is resolved here.
NOT_RESUMED = ("model", "out", "resume", "device_type")


def refuse_math_changes(saved: TrainSettings, explicit: dict[str, Any], path: Path) -> None:
    """Refuse a resume whose flags would change what the checkpoint's optimizer state fixes.

    Raises:
        UsageError: a flag of :data:`FIXED_ON_RESUME` with another value than the run's.
    """
    for name in FIXED_ON_RESUME:
        if name in explicit and explicit[name] != getattr(saved, name):
            raise UsageError(f"checkpoint {path} was trained with {flag(name)} "
                             f"{getattr(saved, name)!r}, which its optimizer state keeps: a "
                             f"resumed run cannot change it to {explicit[name]!r} (drop "
                             f"{flag(name)})")


def layout_notes(saved: TrainSettings, settings: TrainSettings, explicit: dict[str, Any],
                 path: Path) -> list[str]:
    """One line when a resumed run's sharding or DDP kind, not given, differs from its
    checkpoint's, which was not the default there: a new rank layout is resolved afresh
    (:func:`resumed_settings`), with the defaults of its number of ranks."""
    changed = [n for n in ("sharding", "ddp")
               if n not in explicit and getattr(settings, n) != getattr(saved, n)]
    if not changed or (saved.sharding, saved.ddp) == default_layout(saved.nproc, None, None):
        return []
    was = " ".join(f"{flag(n)} {getattr(saved, n)}" for n in ("sharding", "ddp"))
    now = " ".join(f"{flag(n)} {getattr(settings, n)}" for n in ("sharding", "ddp"))
    keep = " ".join(f"{flag(n)} {getattr(saved, n)}" for n in changed)
    return [f"{path} was saved by {saved.nproc} rank(s) with {was}; on {settings.nproc} "
            f"rank(s) the layout is chosen afresh: {now} (pass {keep} to keep it)"]


def resumed_settings(saved: TrainSettings, explicit: dict[str, Any], device_type: str,
                     torchrun_world: int | None) -> dict[str, Any]:
    """The settings of a resumed run: every one of the checkpoint's, except those given.

    The rank layout (:data:`LAYOUT_FIELDS`) is kept as a whole, or resolved afresh for the
    new one when any of it or another ``--tp`` is given, the device type differs, or
    torchrun starts another number of ranks.
    """
    keep = {f.name: getattr(saved, f.name) for f in fields(TrainSettings)
            if f.name not in NOT_RESUMED}
    # The checkpoint's precision and compilation are kept as they were chosen, also on
    # another device (resolve_settings); one given is no longer the device's choice.
    keep["auto"] = ",".join(n for n in str(saved.auto).split(",") if n and n not in explicit)
    # Another --tp is another number of data-parallel ranks: a new layout too (the
    # checkpoint holds whole tensors, which load at any --tp).
    new_tp = "tp" in explicit and explicit["tp"] != saved.tp
    new_layout = (any(n in explicit for n in LAYOUT_FIELDS) or device_type != saved.device_type
                  or (torchrun_world is not None and torchrun_world != saved.nproc) or new_tp)
    if new_layout:
        keep.update({n: None for n in LAYOUT_FIELDS})
    if new_tp and explicit["tp"] == 1 and "sequence_parallel" not in explicit:
        keep["sequence_parallel"] = False  # nothing to cut the sequence over
    elif keep["sharding"] == "zero1" and keep["ddp"] not in (None, "none"):
        # A checkpoint of 0.4, where zero1 behind a DDP wrapper was the pairing that is
        # now called zero1-allreduce: continue it as it ran.
        keep["sharding"] = "zero1-allreduce"
    keep.update(explicit)
    return keep


def _device_type(requested: str) -> str:
    from lab2_trainer.runtime.launch import resolve_device_type

    return resolve_device_type(requested)


def _error(message: str) -> int:
    print(f"lab2-train: error: {message}", file=sys.stderr, flush=True)
    return EXIT_BAD_INPUT


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``lab2-train``; returns the exit code."""
    from lab2_trainer.runtime.wall_clock import mark_launch

    mark_launch()  # the run's start-up is counted from here
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:
        from lab2_trainer.cli.plan import main as plan_main

        return plan_main(argv[1:])
    if argv[:1] == ["export"]:
        return export_main(argv[1:])
    try:
        args = build_parser().parse_args(argv)
    except UsageError as exc:
        return _error(str(exc))
    # torch is imported only now, so that `--help` and the bench dispatch stay quick.
    from lab2_trainer.runtime import launch, supervise
    from lab2_trainer.training.loop import train

    mark_launch("imports")
    # SIGTERM takes the same orderly path as Ctrl-C, here and in the ranks.
    previous = supervise.install_termination_handler()
    claim = settings = None
    notes: list[str] = []
    try:
        try:
            given = given_settings(args)
            device_type = launch.resolve_device_type(given[0].get("device", "auto"))
            torchrun_world = _torchrun_world()
            under_torchrun = torchrun_world is not None
            settings, _ = resolve_settings(given, device_type, torchrun_world, notes)
            # A resumed run keeps its checkpoint's --device unless one is given.
            device_type = settings.device_type
            world_size, timeout_s = settings.nproc, settings.timeout
            if not under_torchrun or int(os.environ["RANK"]) == 0:
                claim = _claim_out(settings)
                _write_settings(settings)
                for note in notes:
                    print(f"lab2-train: note: {note}", file=sys.stderr, flush=True)
        except UsageError as exc:
            return _error(str(exc))
        if under_torchrun:
            # The rank entry of a local run too (spawn_local): one launch path.
            code = launch.run_rank(train, (settings,), device_type, timeout_s)
            if code:
                # A failed or stopped rank ends at once, as a local one does: not through
                # the interpreter's shutdown, where Gloo's threads may still be running.
                if claim is not None:
                    claim.release()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
            return code
        if world_size > 1:
            if device_type == "cpu":
                _preload(settings)
            return launch.spawn_local(world_size, device_type, train, settings, timeout_s=timeout_s,
                                      stop_note=lambda: checkpoint_note(settings))
        return _run_single(settings, device_type, timeout_s)
    except KeyboardInterrupt as exc:
        code = supervise.exit_code_for(exc)
        note = checkpoint_note(settings) if settings is not None else "nothing was written"
        print(f"lab2-train: {'stopped by SIGTERM' if code == 143 else 'interrupted'}; {note}",
              file=sys.stderr, flush=True)
        return code
    finally:
        if claim is not None:
            claim.release()
        supervise.restore_termination_handler(previous)


def checkpoint_note(settings) -> str:
    """What a stopped run says of its checkpoints: the last one is intact, or none was
    written (and the one resumed from, if any, is untouched)."""
    from lab2_trainer.checkpoint.folders import CKPT_DIR, newest_step
    from lab2_trainer.checkpoint.single_file import CHECKPOINT_NAME

    out = Path(settings.out)
    if (out / CHECKPOINT_NAME).is_file() or (
            (out / CKPT_DIR).is_dir() and newest_step(out / CKPT_DIR) is not None):
        return "the last checkpoint is intact"
    if settings.resume:
        return f"no checkpoint was written yet; {settings.resume} is untouched"
    return "no checkpoint was written yet"


def export_main(argv: list[str]) -> int:
    """``lab2-train export CKPT OUT``: a sharded checkpoint as one file."""
    p = _Parser(prog="lab2-train export",
                description="Write a sharded checkpoint (a step folder, or the newest of a "
                "run) as one file: a plain torch.load holding the model's state dict and "
                "AdamW's own state dict, which --resume also takes.")
    p.add_argument("checkpoint", metavar="CKPT", help="a run folder, its ckpt/ folder or a "
                   "ckpt/step-N folder")
    p.add_argument("out", metavar="OUT", help="the file to write")
    try:
        args = p.parse_args(argv)
        from lab2_trainer.checkpoint.export import write_export

        return write_export(args.checkpoint, args.out)
    except UsageError as exc:
        return _error(str(exc))


def _claim_out(settings):
    """Claim ``--out`` for this run (refused while another live run holds it), then remove
    the temporary files interrupted checkpoint writes left there and beside the checkpoint
    resumed from."""
    from lab2_trainer.checkpoint.folders import has_checkpoint, step_folder_notes
    from lab2_trainer.runtime.run_folder import (
        LOCK_NAME,
        claim_folder,
        clean_stale_temporaries,
        folder_is_claimed,
    )

    claim = claim_folder(settings.out)
    try:
        if settings.resume is None and has_checkpoint(settings.out):
            # A run finished there between the first check and the claim.
            raise UsageError(f"{settings.out} holds a checkpoint: pass --resume to continue "
                             "that run, or choose another --out (nothing was overwritten)")
        removed = clean_stale_temporaries(settings.out, only_dead_writers=False)
        if settings.resume is not None:
            source = Path(settings.resume).parent
            if source.resolve() != Path(settings.out).resolve() and not folder_is_claimed(source):
                removed += clean_stale_temporaries(source, only_dead_writers=True)
        incomplete = step_folder_notes(settings)
    except BaseException:
        claim.release()
        raise
    if claim.took_over is not None:
        pid = claim.took_over.get("pid")
        why = (f"whose claim by pid {pid} was stale (that process is gone)"
               if isinstance(pid, int) and not isinstance(pid, bool) else
               f"whose claim file could not be read (empty or damaged, {LOCK_NAME}) and "
               "was not locked by any process")
        print(f"lab2-train: note: took over {settings.out}, {why}", file=sys.stderr, flush=True)
    if removed:
        print(f"lab2-train: note: removed {len(removed)} temporary file(s) left by interrupted "
              f"writes: {', '.join(removed)}", file=sys.stderr, flush=True)
    for note in incomplete:
        print(f"lab2-train: note: {note}", file=sys.stderr, flush=True)
    return claim


def _write_settings(settings) -> None:
    """The resolved settings as ``settings.toml`` in the run folder (atomically), which
    ``--config`` takes back to rerun the run."""
    from lab2_trainer.cli.settings_file import to_toml
    from lab2_trainer.runtime.run_folder import atomic_write_text

    atomic_write_text(Path(settings.out) / SETTINGS_NAME, to_toml(settings))


def _preload(settings) -> None:
    """Import what every rank will import, once, before the ranks are forked from here
    (each import would otherwise be repeated by every rank, costing CPU seconds on a
    machine without cached bytecode)."""
    import contextlib
    import importlib

    names = ["torch._dynamo", "minddp", "zero1"]  # torch.optim's optimizers import dynamo
    if settings.tp > 1:
        names.append("minitp")
    if settings.model.norm in ("tritonnorm", "reference"):
        names.append("tritonnorm")
    for name in names:
        with contextlib.suppress(ImportError):  # the rank that needs it reports the failure
            importlib.import_module(name)


def _run_single(settings, device_type: str, timeout_s: float | None = None) -> int:
    """One rank in this process; a one-rank Gloo/NCCL group when a DDP or sharded optimizer
    was asked for (they are collectives, even alone)."""
    import torch

    from lab2_trainer.runtime import launch
    from lab2_trainer.runtime.wall_clock import mark_launch
    from lab2_trainer.training.loop import train

    need_group = settings.ddp != "none" or settings.sharding != "none"
    device = launch.rank_device(device_type, 0)
    try:
        if need_group:
            # An in-memory store: alone, there is no one to meet, and no rendezvous folder
            # to leave behind if this process is killed.
            launch.dist.init_process_group("nccl" if device_type == "cuda" else "gloo",
                                           store=launch.dist.HashStore(), rank=0, world_size=1,
                                           timeout=timedelta(seconds=timeout_s or
                                                             launch.DEFAULT_TIMEOUT_S))
        torch.set_num_threads(launch.threads_per_rank(1))
        mark_launch("device")
        train(launch.DistContext(device=device), settings)
    except UsageError as exc:
        return _error(str(exc))
    except Exception as exc:  # a refused write (a full disk) is one line, not a traceback
        from lab2_trainer.config import Diverged
        from lab2_trainer.runtime.run_folder import WriteFailed, write_failure

        line = str(exc) if isinstance(exc, (WriteFailed, Diverged)) else write_failure(exc)
        if line is None:
            raise
        print(f"lab2-train: error: {line}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    finally:
        if need_group and launch.dist.is_initialized():
            launch.dist.destroy_process_group()
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
