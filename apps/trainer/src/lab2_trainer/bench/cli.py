"""``lab2-train bench SUITE [options]``: the model-level benchmark suites.

Every suite takes the common options (``--quick``, ``--out``, ``--device``, ``--preset``,
``--precision``, batch and context sizes, warm-up and step counts); ``--quick`` runs a micro
model on the CPU in seconds. ``lab2-train bench SUITE --help`` lists a suite's own options.

The suites are lab2bench ``Suite`` objects, run by lab2bench's runner: this package
declares them as entry points of the group ``lab2bench.suites`` under the names
``train-<suite>`` (``lab2bench train-e2e --quick`` is ``lab2-train bench e2e --quick``).
Each suite's help and options come from :mod:`.arguments`, which imports no torch; the
module that runs it is imported only when it runs, so that ``--help`` stays quick.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Sequence
from types import ModuleType

from lab2_trainer import __version__
from lab2_trainer.bench.arguments import SUITES, add_common_arguments, preset_names
from lab2bench.suites import Suite


def suite_module(name: str) -> ModuleType:
    """The module that runs suite ``name`` (its ``run(args, out)``); it imports torch."""
    return importlib.import_module(f"lab2_trainer.bench.{SUITES[name].module}")


#: What ``--quick`` sets for every option the user did not give.
QUICK = dict(device="cpu", presets=["micro"], batch_size=2, context_length=16, warmup=1,
             steps=2, rounds=1)
#: Defaults otherwise (the handout's table: 5 warm-up steps, 10 timed).
FULL = dict(device="auto", presets=["small"], batch_size=4, context_length=256, warmup=5,
            steps=10, rounds=3)


def _fill_defaults(args: argparse.Namespace) -> None:
    from lab2bench.devices import resolve_device

    base = QUICK if args.quick else FULL
    for key, value in base.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    for key in ("batch_size", "context_length", "steps"):
        if getattr(args, key) < 1:
            raise SystemExit(f"lab2-train bench: --{key.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        raise SystemExit("lab2-train bench: --warmup must be >= 0")
    unknown = [p for p in args.presets if p not in preset_names()]
    if unknown:
        raise SystemExit(f"lab2-train bench: unknown preset(s) {', '.join(unknown)}; "
                         f"choose from {', '.join(preset_names())}")
    args.overrides = _parse_overrides(args.overrides)
    if args.threads is not None and args.threads < 1:
        raise SystemExit("lab2-train bench: --threads must be >= 1")
    if args.quick and args.threads is None:
        # On a small shared CPU, a second OpenMP thread waiting at every barrier for a core
        # that another process holds makes tiny ops 100x slower.
        args.threads = 1
    requested = None if args.device == "auto" else args.device
    try:
        device = resolve_device(requested)
    except (ValueError, RuntimeError) as err:
        raise SystemExit(f"lab2-train bench: {err}") from None
    # A device asked for by its type alone (or auto) is recorded by its type, as "cuda".
    args.device = device.type if requested in (None, device.type) else str(device)


def _parse_overrides(items: list[str]) -> dict[str, object]:
    import dataclasses

    from lab2_trainer.config import ModelConfig

    own_option = ("context_length", "vocab_size", "norm")
    types = {f.name: type(f.default) for f in dataclasses.fields(ModelConfig)
             if f.name not in own_option}
    out: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in types:
            raise SystemExit(f"lab2-train bench: --set {item!r}: expected FIELD=VALUE with FIELD "
                             f"one of {', '.join(types)} (context length, vocabulary and norm "
                             "have their own options)")
        kind = types[key]
        try:
            out[key] = (value.lower() in ("1", "true", "yes")) if kind is bool else kind(value)
        except ValueError:
            raise SystemExit(f"lab2-train bench: --set {item!r}: {value!r} is not a "
                             f"{kind.__name__}") from None
    return out


def _add_arguments(name: str, parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    SUITES[name].add_arguments(parser)


def _run(name: str, args: argparse.Namespace) -> int:
    """Run suite ``name`` with the parsed options: fill the defaults, collect the suite's
    rows in a ``SuiteOutput`` and write them out."""
    # torch is imported only now, so that `--help` stays quick.
    import torch

    from lab2bench.suites import SuiteOutput

    args.suite = name
    _fill_defaults(args)
    module = suite_module(name)
    out = SuiteOutput(name, args.out)
    t0 = time.perf_counter()
    saved_threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        module.run(args, out)
    finally:
        torch.set_num_threads(saved_threads)
    out.finish()
    where = f"; results in {args.out}" if args.out else ""
    print(f"[bench {name}] {len(out.rows)} rows in {time.perf_counter() - t0:.1f}s{where}",
          flush=True)
    return 0


#: The trainer's suites are ``train-<suite>`` in the ``lab2bench`` command, where a plain
#: ``norm`` would clash with tritonnorm's.
LAB2BENCH_PREFIX = "train-"


def lab2bench_suite(name: str) -> Suite:
    """Suite ``name`` as a lab2bench ``Suite``, named ``train-<name>``."""
    return Suite(f"{LAB2BENCH_PREFIX}{name}", SUITES[name].help,
                 lambda parser: _add_arguments(name, parser), lambda args: _run(name, args))


#: Every suite by its name in ``lab2-train bench``.
BENCH_SUITES = {name: lab2bench_suite(name) for name in SUITES}
# The entry points of the group ``lab2bench.suites`` (pyproject.toml) name these.
E2E = BENCH_SUITES["e2e"]
PRECISION = BENCH_SUITES["precision"]
COMPILE = BENCH_SUITES["compile"]
NORM = BENCH_SUITES["norm"]
MEMORY = BENCH_SUITES["memory"]
DDP = BENCH_SUITES["ddp"]
ZERO = BENCH_SUITES["zero"]
STACK = BENCH_SUITES["stack"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run one suite through lab2bench's runner. Returns the exit code; bad options exit
    with a one-line message."""
    from lab2bench.cli import main as run_suites

    return run_suites(list(sys.argv[1:] if argv is None else argv), suites=BENCH_SUITES,
                      prog="lab2-train bench",
                      description="Model-level benchmark suites of the lab2 Transformer.",
                      version=f"lab2-train {__version__}")


if __name__ == "__main__":
    raise SystemExit(main())
