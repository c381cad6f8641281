"""Every suite's one-line help and options, in a module that imports no torch.

``lab2-train bench SUITE --help`` (and ``lab2bench train-SUITE --help``) builds its parser
from here alone; the module that runs a suite (``SUITES[name].module``, which imports torch
and the model) is imported only when the suite runs. The suite modules take the names their
options accept (``MODES``, ``NORMS``, ``DDP_VARIANTS``...) from here.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NamedTuple

from lab2_trainer.config import BACKWARD_THREADS, BUCKET_RULES, NORM_KINDS, PRECISIONS, PRESETS
from lab2bench.suites.base import comma_list

#: The units a single-device suite times: a forward (loss included), forward+backward,
#: a whole training step.
MODES = ("forward", "forward_backward", "train_step")
#: The norm layers the ``norm`` suite swaps in.
NORMS = list(NORM_KINDS)
#: The ``ddp`` suite's variants; the bfloat16-wire ones run only when asked for.
DDP_VARIANTS = ("local", "naive", "flat", "individual", "bucketed", "torch", "bucketed_bf16",
                "torch_bf16")
DDP_DEFAULT_VARIANTS = DDP_VARIANTS[:6]
#: Every way of sharding the ``zero`` and ``stack`` suites compare, by the name they print:
#: (the trainer's ``--sharding``, its ``--ddp``, FSDP2's ``reshard_after_forward``). The DDP
#: wrapper, where there is one, is PyTorch's, so that only the sharding differs.
SHARDINGS: dict[str, tuple[str, str, bool]] = {
    "adamw": ("none", "torch", True),
    "zero1": ("zero1", "none", True),
    "zero2": ("zero2", "none", True),
    "zero1-allreduce": ("zero1-allreduce", "torch", True),
    "torch_zero": ("torch", "torch", True),
    "fsdp": ("fsdp", "none", True),
    "fsdp-keep": ("fsdp", "none", False),
}
#: The ``zero`` suite's variants.
ZERO_VARIANTS = tuple(SHARDINGS)
#: The ``stack`` suite's stacks: (whose norm, the sharding of ``SHARDINGS``, the DDP
#: wrapper where that sharding takes one). "ours" is the trainer's default on several
#: ranks; "pytorch" is DistributedDataParallel + ZeroRedundancyOptimizer + nn.RMSNorm.
STACKS: dict[str, tuple[str, str, str | None]] = {
    "ours": ("ours", "zero1", None),
    "ours-zero2": ("ours", "zero2", None),
    "ours-allreduce": ("ours", "zero1-allreduce", "bucketed"),
    "ours-fsdp": ("ours", "fsdp", None),
    "pytorch": ("pytorch", "torch_zero", "torch"),
    "pytorch-fsdp": ("pytorch", "fsdp", None),
    "pytorch-fsdp-keep": ("pytorch", "fsdp-keep", None),
}


def preset_names() -> list[str]:
    """Every preset a suite accepts: the trainer's plus ``micro`` (the bench-only model of
    ``--quick`` runs)."""
    return ["micro", *PRESETS]


def _split(text: str) -> list[str]:
    return text.split(",")


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every suite takes (lab2bench's runner adds --quick, --out and --device)."""
    g = parser.add_argument_group("common options")
    g.add_argument("--preset", dest="presets", type=comma_list(str), default=None,
                   metavar="P[,P...]",
                   help=f"model presets, comma-separated: {', '.join(preset_names())}")
    g.add_argument("--precision", default="fp32", choices=list(PRECISIONS),
                   help="autocast precision (default fp32)")
    g.add_argument("--batch-size", type=int, default=None, help="sequences per step (per rank)")
    g.add_argument("--context-length", type=int, default=None, help="tokens per sequence")
    g.add_argument("--vocab-size", type=int, default=None, help="override the preset's vocabulary")
    g.add_argument("--norm", default=None,
                   help=f"norm layer of the model ({', '.join(NORM_KINDS)})")
    g.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="FIELD=VALUE",
                   help="override a model config field, e.g. --set n_layers=4 (repeatable)")
    g.add_argument("--warmup", type=int, default=None, help="untimed steps first")
    g.add_argument("--steps", type=int, default=None, help="timed steps")
    g.add_argument("--seed", type=int, default=0, help="model and data seed")
    g.add_argument("--backward-thread", default="caller", choices=list(BACKWARD_THREADS),
                   help="the thread that runs backward: caller (default, as the trainer "
                        "does) or autograd (PyTorch's default, its worker thread per device)")
    g.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (per rank for ddp/zero/stack; default: 1 with "
                        "--quick, else torch's default, or cores // world size per rank)")


def add_rank_arguments(parser: argparse.ArgumentParser, *, default_world_size: int = 2) -> None:
    """The options of the suites that spawn ranks (``ddp``, ``zero``, ``stack``)."""
    parser.add_argument("--world-size", type=int, default=default_world_size,
                        help=f"ranks to spawn (default {default_world_size}; Gloo on the CPU, "
                             "NCCL with one GPU per rank on CUDA)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="measure every variant this many times, order rotated each round "
                             "(default 3; 1 with --quick)")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds before the ranks are killed (default 1800)")
    parser.add_argument("--timing", choices=("throughput", "latency"), default="throughput",
                        help="throughput (default): the timed steps run back to back, as in "
                             "training, and their events are read at the end; latency: each "
                             "step starts after a barrier on an idle GPU")


def _e2e(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--modes", type=_split, default=["forward", "forward_backward"],
                        help=f"comma-separated, from {', '.join(MODES)}")


def _precision(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--precisions", type=_split, default=None,
                        help="comma-separated (default fp32,bf16, plus fp16 on CUDA)")
    parser.add_argument("--modes", type=_split, default=list(MODES),
                        help=f"comma-separated, from {', '.join(MODES)}")


def _compile(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default=None,
                        help="torch.compile backend (default inductor; aot_eager with --quick, "
                             "which needs no C++ compiler and compiles in seconds)")
    parser.add_argument("--mode", dest="compile_mode", default=None,
                        help="torch.compile mode (e.g. max-autotune)")
    parser.add_argument("--modes", type=_split,
                        default=["forward", "forward_backward", "train_step"],
                        help=f"comma-separated, from {', '.join(MODES)}")


def _norm(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--norms", type=_split, default=NORMS,
                        help=f"comma-separated, from {', '.join(NORMS)}")
    parser.add_argument("--modes", type=_split, default=["forward_backward", "train_step"],
                        help=f"comma-separated, from {', '.join(MODES)}")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved rounds: each builds and times every norm's model once "
                             "(default 3; 1 with --quick)")
    g = parser.add_argument_group("profile")
    g.add_argument("--profile", action="store_true",
                   help="also profile a few steps of each norm's model (torch.profiler): the "
                        "norm ops' CPU µs per call (forward op and backward node) and the top "
                        "ops by CPU time; with --out, norm-profile.jsonl and .md")
    g.add_argument("--profile-steps", type=int, default=None,
                   help="profiled steps per norm, after --warmup steps (default 5; 2 with --quick)")
    g.add_argument("--profile-mode", default="train_step", choices=list(MODES),
                   help="the step profiled (default train_step)")
    g.add_argument("--profile-top", type=int, default=15,
                   help="rows of each top-ops table (default 15)")
    g.add_argument("--profile-trace", action="store_true",
                   help="with --out, also write a Chrome trace per profile "
                        "(norm-profile-PRESET-NORM.trace.json; tens of MB for medium)")


def _memory(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--context-lengths", type=lambda s: [int(x) for x in s.split(",")],
                        default=None, help="comma-separated (default: --context-length)")
    parser.add_argument("--no-snapshot", action="store_true",
                        help="skip the CUDA memory snapshot of the full step")


def _bucket_rule(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bucket-rule", default="reach", choices=list(BUCKET_RULES),
                        help="how the bucket size cuts DDPBucketed's buckets: reach (default, "
                             "as the trainer and PyTorch DDP do) or at_most")


def _ddp(parser: argparse.ArgumentParser) -> None:
    add_rank_arguments(parser)
    parser.add_argument("--variants", type=_split, default=list(DDP_DEFAULT_VARIANTS),
                        help=f"comma-separated, from {', '.join(DDP_VARIANTS)} (bucketed runs "
                             "once per bucket size)")
    parser.add_argument("--bucket-mb", type=lambda s: [float(x) for x in s.split(",")],
                        default=None, help="bucket sizes in MB for 'bucketed' "
                                           "(default 1,5,25,100)")
    parser.add_argument("--sweep", action="store_true",
                        help="bucket sizes 1,5,10,25,50,100,500 MB")
    _bucket_rule(parser)
    parser.add_argument("--torch-bucket-mb", type=float, default=25.0,
                        help="bucket_cap_mb of PyTorch DDP (default 25)")
    parser.add_argument("--trace", action="store_true",
                        help="profile one extra step per variant (Chrome traces under --out); "
                             "on CUDA also report the NCCL/compute overlap")


def _zero(parser: argparse.ArgumentParser) -> None:
    add_rank_arguments(parser)
    parser.add_argument("--variants", type=_split, default=list(ZERO_VARIANTS),
                        help=f"comma-separated, from {', '.join(ZERO_VARIANTS)}")


def _stack(parser: argparse.ArgumentParser) -> None:
    add_rank_arguments(parser)
    parser.add_argument("--variants", type=_split, default=list(STACKS),
                        help=f"comma-separated, from {', '.join(STACKS)} (default all)")
    parser.add_argument("--bucket-mb", type=float, default=25.0,
                        help="DDPBucketed's bucket size (default 25, PyTorch DDP's default)")
    _bucket_rule(parser)
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile both models (the same way) before wrapping them")
    parser.add_argument("--backend", default=None,
                        help="torch.compile backend (default inductor; aot_eager with --quick)")
    parser.add_argument("--compile-mode", default=None,
                        help="torch.compile mode (e.g. max-autotune)")


class SuiteInfo(NamedTuple):
    """What the command line knows of a suite without importing it."""

    module: str
    """The module under ``lab2_trainer.bench`` whose ``run(args, out)`` runs it."""
    help: str
    """One line for ``--help`` and ``list``."""
    add_arguments: Callable[[argparse.ArgumentParser], None]
    """Adds the suite's own options (after the common ones)."""


#: Every suite by its name in ``lab2-train bench``.
SUITES = {
    "e2e": SuiteInfo("e2e", "forward and forward+backward time per preset (warm-up excluded, "
                            "mean and std)", _e2e),
    "precision": SuiteInfo("precision", "fp32 vs bf16 (and fp16) autocast: forward, "
                                        "forward+backward and training step", _precision),
    "compile": SuiteInfo("compiled", "eager vs torch.compile: forward, forward+backward and "
                                     "training step", _compile),
    "norm": SuiteInfo("norm_swap", "norm swap in the full model: tritonnorm vs reference vs "
                                   "torch RMSNorm vs LayerNorm", _norm),
    "memory": SuiteInfo("memory", "peak memory of forward, forward+backward and full AdamW "
                                  "step per preset/context length", _memory),
    "ddp": SuiteInfo("ddp", "DDP variants (naive, flat, individual, bucketed sweep) vs torch "
                            "DDP: step time and exposed communication, N ranks in one run",
                     _ddp),
    "zero": SuiteInfo("zero", "ShardedOptimizer vs ZeroRedundancyOptimizer vs unsharded AdamW: "
                              "memory at setup, before and after the step, state bytes per "
                              "rank, step time", _zero),
    "stack": SuiteInfo("stack", "tokens/s: DDPBucketed + ShardedOptimizer + tritonnorm vs "
                                "DistributedDataParallel + ZeroRedundancyOptimizer + torch "
                                "RMSNorm", _stack),
}
