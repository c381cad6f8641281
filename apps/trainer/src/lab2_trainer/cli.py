"""``lab2-train``: train the Transformer LM; ``lab2-train bench ...``: the model-level benchmarks.

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
from lab2_trainer.config import NORM_KINDS, PRESETS, ModelConfig, model_config
from lab2_trainer.errors import UsageError

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
MODEL_FLAGS = ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "context_length", "norm",
               "eps", "tie_embeddings", "ffn")
DEFAULT_CPU_RANKS = 2


def build_parser() -> argparse.ArgumentParser:
    """The command line; every default is None so an explicit value can be told apart."""
    p = argparse.ArgumentParser(
        prog="lab2-train",
        description="Train a decoder-only Transformer LM on tritonnorm, minddp and zero1. "
        "`lab2-train bench --help` lists the benchmark suites.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    m = p.add_argument_group("model")
    m.add_argument("--preset", choices=list(PRESETS), help="size preset (default tiny)")
    m.add_argument("--d-model", type=int)
    m.add_argument("--n-layers", type=int)
    m.add_argument("--n-heads", type=int)
    m.add_argument("--d-ff", type=int)
    m.add_argument("--context-length", type=int)
    m.add_argument("--norm", choices=list(NORM_KINDS), help="norm layer (default tritonnorm)")
    m.add_argument("--eps", type=float)
    m.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None)
    m.add_argument("--ffn", choices=["swiglu", "gelu"])
    d = p.add_argument_group("data")
    d.add_argument("--data", help="text file, folder, or .npy/.bin token array "
                   "(default: this Python's standard-library sources)")
    d.add_argument("--vocab-size", type=int, help="vocabulary of a token-array --data")
    t = p.add_argument_group("optimisation")
    t.add_argument("--steps", type=int, help="optimizer steps (default 200)")
    t.add_argument("--batch-size", type=int, help="global batch in sequences (default 32)")
    t.add_argument("--grad-accum", type=int, help="micro-batches per step (default 1)")
    t.add_argument("--lr", type=float, help="peak learning rate (default 3e-3)")
    t.add_argument("--min-lr", type=float, help="final learning rate (default 3e-4)")
    t.add_argument("--warmup", type=int, help="warm-up steps (default 20)")
    t.add_argument("--weight-decay", type=float, help="AdamW weight decay (default 0.1)")
    t.add_argument("--clip", type=float, help="gradient-norm clip, 0 = off (default 1.0)")
    t.add_argument("--precision", choices=["fp32", "bf16", "fp16"], help="(default fp32)")
    t.add_argument("--compile", action="store_true", default=None, help="torch.compile the model")
    t.add_argument("--compile-backend", help="torch.compile backend (default inductor)")
    t.add_argument("--compile-mode", help="torch.compile mode, e.g. max-autotune (default none)")
    t.add_argument("--seed", type=int, help="seed of weights, data and samples (default 0)")
    r = p.add_argument_group("parallelism")
    r.add_argument("--nproc", type=int, help=f"local ranks to spawn (default {DEFAULT_CPU_RANKS} "
                   "on CPU, 1 on GPU; ignored under torchrun)")
    r.add_argument("--ddp", choices=["bucketed", "individual", "flat", "naive", "torch", "none"],
                   help="gradient averaging (default bucketed with >1 rank, else none)")
    r.add_argument("--bucket-mb", type=float, help="DDP bucket size in MiB (default 25)")
    r.add_argument("--sharding", choices=["none", "zero1", "torch"],
                   help="optimizer-state sharding (default zero1 with >1 rank, else none)")
    r.add_argument("--device", default="auto", help="auto, cpu or cuda")
    r.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="how long a collective waits for the other ranks, and how long a "
                   "rank may go silent, before the run fails naming it (default 300)")
    o = p.add_argument_group("outputs")
    o.add_argument("--out", help="output folder (default runs/<preset>-<time>)")
    o.add_argument("--resume", nargs="?", const="", default=None, metavar="PATH",
                   help="continue from a checkpoint (file or run folder; alone: --out's, or "
                   "the newest under runs/)")
    o.add_argument("--ckpt-every", type=int, help="checkpoint every N steps (default: at the end)")
    o.add_argument("--eval-every", type=int, help="validate every N steps (default 50)")
    o.add_argument("--eval-batches", type=int, help="batches per validation (default 8)")
    o.add_argument("--log-every", type=int, help="log line every N steps off a terminal")
    o.add_argument("--sample-tokens", type=int, help="length of the final sample (default 300)")
    o.add_argument("--quiet", action="store_true", default=None, help="no console progress")
    o.add_argument("--plot", action=argparse.BooleanOptionalAction, default=None,
                   help="draw loss_curve.png at the end (default on)")
    return p


def _explicit(args: argparse.Namespace, names) -> dict[str, Any]:
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def _newest_run_checkpoint(root: Path = Path("runs")) -> Path:
    from lab2_trainer.checkpoint import CHECKPOINT_NAME

    found = sorted(root.glob(f"*/{CHECKPOINT_NAME}"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise UsageError(f"--resume without a path: no {root}/*/{CHECKPOINT_NAME} found")
    return found[-1]


def _resolve_world(args: argparse.Namespace, device_type: str) -> tuple[int, bool]:
    from lab2_trainer.distributed import launched_by_torchrun

    if launched_by_torchrun():
        return int(os.environ["WORLD_SIZE"]), True
    nproc = args.nproc
    if nproc is None:
        nproc = DEFAULT_CPU_RANKS if device_type == "cpu" else 1
    if nproc < 1:
        raise UsageError(f"--nproc must be >= 1, got {nproc}")
    return nproc, False


def resolve_settings(args: argparse.Namespace, world_size: int, device_type: str):
    """Turn the command line (and a checkpoint, when resuming) into checked settings.

    Returns:
        (settings, corpus) with the corpus loaded once here, which also checks the data
        and warms its cache before the ranks start.
    """
    from lab2_trainer.checkpoint import CHECKPOINT_NAME, load_checkpoint, resolve_checkpoint_path
    from lab2_trainer.data import check_batch_layout, load_corpus
    from lab2_trainer.settings import TRAJECTORY_FIELDS, TrainSettings
    from lab2_trainer.validate_inputs import (
        check_checkpoint_fits,
        check_memory,
        check_numbers,
        check_out_path,
    )

    model_overrides = _explicit(args, MODEL_FLAGS)
    train_names = [f.name for f in fields(TrainSettings) if f.name not in ("model", "resume",
                                                                            "out", "device_type")]
    explicit = _explicit(args, train_names)
    ckpt = None
    if args.resume is not None:
        if args.resume:
            path = resolve_checkpoint_path(args.resume)
        elif args.out:
            path = resolve_checkpoint_path(args.out)
        else:
            path = _newest_run_checkpoint()
        ckpt = load_checkpoint(path)
        try:
            saved = TrainSettings.from_dict(ckpt["settings"])
            saved_model = ModelConfig.from_dict(ckpt["model_config"])
        except (KeyError, TypeError, ValueError) as exc:
            raise UsageError(f"checkpoint {path} has unusable settings: {exc}") from None
        if args.preset is not None:
            model_overrides = {**PRESETS[args.preset], **model_overrides}
        for name, value in model_overrides.items():
            if getattr(saved_model, name) != value:
                raise UsageError(
                    f"checkpoint {path} is incompatible: its model has {name}="
                    f"{getattr(saved_model, name)!r}, the command line asks for {value!r}"
                )
        keep = {n: getattr(saved, n) for n in TRAJECTORY_FIELDS}
        keep.update({n: v for n, v in explicit.items()})
        settings = TrainSettings(model=saved_model, **keep)
        settings.out = args.out or str(path.parent)
        settings.resume = str(path)
    else:
        try:
            model = model_config(args.preset or "tiny", **model_overrides)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        settings = TrainSettings(model=model, **explicit)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        settings.out = args.out or os.path.join("runs", f"{args.preset or 'tiny'}-{stamp}")
        existing = Path(settings.out) / CHECKPOINT_NAME
        if existing.exists():
            from lab2_trainer.run_claim import in_use_message, live_claim

            owner = live_claim(settings.out)
            if owner is not None:
                raise UsageError(in_use_message(settings.out, owner))
            raise UsageError(f"{existing} exists: pass --resume to continue that run, or "
                             "choose another --out (nothing was overwritten)")
    settings.device_type = device_type
    settings.ddp = explicit.get("ddp", "bucketed" if world_size > 1 else "none")
    settings.sharding = explicit.get("sharding", "zero1" if world_size > 1 else "none")
    check_numbers(settings, getattr(args, "timeout", None))
    check_out_path(settings.out)
    try:
        settings.validate(world_size)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    check_memory(settings, world_size, device_type)
    check_batch_layout(settings.batch_size, world_size, settings.grad_accum)
    corpus = load_corpus(settings.data, settings.vocab_size)
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
    if ckpt is not None:
        check_checkpoint_fits(ckpt, settings, path)
    return settings, corpus


def _run_bench(argv: list[str]) -> int:
    try:
        from lab2_trainer.bench.cli import main as bench_main
    except ImportError as exc:
        print(f"lab2-train: error: the bench suites are not available ({exc})", file=sys.stderr)
        return EXIT_FAILED
    result = bench_main(argv)
    return int(result or 0)


def _error(message: str) -> int:
    print(f"lab2-train: error: {message}", file=sys.stderr, flush=True)
    return EXIT_BAD_INPUT


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``lab2-train``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return _run_bench(argv[1:])
    args = build_parser().parse_args(argv)
    # torch is imported only now, so that `--help` and the bench dispatch stay quick.
    from lab2_trainer import distributed as D
    from lab2_trainer import supervise
    from lab2_trainer.train import train

    # SIGTERM takes the same orderly path as Ctrl-C, here and in the ranks.
    previous = supervise.install_termination_handler()
    claim = None
    try:
        try:
            device_type = D.resolve_device_type(args.device)
            world_size, under_torchrun = _resolve_world(args, device_type)
            settings, _ = resolve_settings(args, world_size, device_type)
            timeout_s = args.timeout or D.DEFAULT_TIMEOUT_S
            if not under_torchrun or int(os.environ["RANK"]) == 0:
                claim = _claim_out(settings)
        except UsageError as exc:
            return _error(str(exc))
        if under_torchrun:
            supervise.set_parent_death_signal()
            ctx = D.init_from_env(device_type, timeout_s)
            try:
                train(ctx, settings)
            except UsageError as exc:
                return _error(str(exc))
            finally:
                D.dist.destroy_process_group()
            return EXIT_OK
        if world_size > 1:
            if device_type == "cpu":
                _preload(settings)
            return D.spawn_local(world_size, device_type, train, settings, timeout_s=timeout_s)
        return _run_single(settings, device_type, timeout_s)
    except KeyboardInterrupt as exc:
        code = supervise.exit_code_for(exc)
        print(f"lab2-train: {'stopped by SIGTERM' if code == 143 else 'interrupted'}; the last "
              "checkpoint is intact", file=sys.stderr, flush=True)
        return code
    finally:
        if claim is not None:
            claim.release()
        supervise.restore_termination_handler(previous)


def _claim_out(settings):
    """Claim ``--out`` for this run (refused while another live run holds it), then remove
    the temporary files interrupted checkpoint writes left there and beside the checkpoint
    resumed from."""
    from lab2_trainer.checkpoint import CHECKPOINT_NAME
    from lab2_trainer.run_claim import claim_folder, clean_stale_temporaries, folder_is_claimed

    claim = claim_folder(settings.out)
    try:
        existing = Path(settings.out) / CHECKPOINT_NAME
        if settings.resume is None and existing.exists():
            # A run finished there between the first check and the claim.
            raise UsageError(f"{existing} exists: pass --resume to continue that run, or "
                             "choose another --out (nothing was overwritten)")
        removed = clean_stale_temporaries(settings.out, only_dead_writers=False)
        if settings.resume is not None:
            source = Path(settings.resume).parent
            if source.resolve() != Path(settings.out).resolve() and not folder_is_claimed(source):
                removed += clean_stale_temporaries(source, only_dead_writers=True)
    except BaseException:
        claim.release()
        raise
    if claim.took_over:
        print(f"lab2-train: note: took over {settings.out}, whose claim by pid "
              f"{claim.took_over.get('pid')} was stale (that process is gone)", file=sys.stderr,
              flush=True)
    if removed:
        print(f"lab2-train: note: removed {len(removed)} temporary file(s) left by interrupted "
              f"writes: {', '.join(removed)}", file=sys.stderr, flush=True)
    return claim


def _preload(settings) -> None:
    """Import what every rank will import, once, before the ranks are forked from here
    (each import would otherwise be repeated by every rank, costing CPU seconds on a
    machine without cached bytecode)."""
    import contextlib
    import importlib

    names = ["torch._dynamo", "minddp", "zero1"]  # torch.optim's optimizers import dynamo
    if settings.model.norm in ("tritonnorm", "reference"):
        names.append("tritonnorm")
    for name in names:
        with contextlib.suppress(ImportError):  # the rank that needs it reports the failure
            importlib.import_module(name)


def _run_single(settings, device_type: str, timeout_s: float | None = None) -> int:
    """One rank in this process; a one-rank Gloo/NCCL group when a DDP or sharded optimizer
    was asked for (they are collectives, even alone)."""
    import torch

    from lab2_trainer import distributed as D
    from lab2_trainer.train import train

    need_group = settings.ddp != "none" or settings.sharding != "none"
    device = D.rank_device(device_type, 0)
    try:
        if need_group:
            # An in-memory store: alone, there is no one to meet, and no rendezvous folder
            # to leave behind if this process is killed.
            D.dist.init_process_group("nccl" if device_type == "cuda" else "gloo",
                                      store=D.dist.HashStore(), rank=0, world_size=1,
                                      timeout=timedelta(seconds=timeout_s or
                                                        D.DEFAULT_TIMEOUT_S))
        torch.set_num_threads(D.threads_per_rank(1))
        train(D.DistContext(device=device), settings)
    except UsageError as exc:
        return _error(str(exc))
    finally:
        if need_group and D.dist.is_initialized():
            D.dist.destroy_process_group()
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
