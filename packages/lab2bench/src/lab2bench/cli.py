"""The ``lab2bench`` command: ``lab2bench <suite> [--quick] [--out DIR] [--device D] ...``.

``lab2bench list`` shows the suites; ``lab2bench <suite> --help`` its options. Other
commands run their own suites through the same runner (``main(argv, suites=...)``), as
``lab2-train bench`` does.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Mapping, Sequence

from lab2bench import __version__
from lab2bench.suites import Suite, available_suites

DESCRIPTION = ("Benchmarks for PyTorch code: each suite prints a Markdown table, and with "
               "--out writes JSON lines, the table and PNG plots.")


def build_parser(
    suites: Mapping[str, Suite] | None = None,
    *,
    options_of: Iterable[str] | None = None,
    prog: str = "lab2bench",
    description: str = DESCRIPTION,
    version: str | None = None,
) -> argparse.ArgumentParser:
    """The argument parser, one subcommand per suite plus ``list``.

    Args:
        suites: the subcommands by name (default: ``available_suites()``).
        options_of: the suites whose options are added (default: all). ``main`` adds only
            the one asked for, so that ``--help`` calls no suite's ``add_arguments``.
        prog, description: of the command.
        version: what ``--version`` prints (default ``"<prog> <lab2bench version>"``).
    """
    suites = available_suites() if suites is None else suites
    options_of = set(suites if options_of is None else options_of)
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--version", action="version",
                        version=version or f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="SUITE")
    sub.add_parser("list", help="list the suites")
    for name, suite in suites.items():
        p = sub.add_parser(name, help=suite.help, description=suite.help)
        if name not in options_of:
            continue
        p.add_argument("--quick", action="store_true",
                       help="tiny shapes on the CPU, done in seconds (a smoke test)")
        p.add_argument("--out", metavar="DIR", default=None,
                       help="write <suite>.jsonl (appended), <suite>.md and PNG plots here")
        p.add_argument("--device", default=None,
                       help="cpu, cuda or cuda:N (default: CUDA if available; cpu with --quick)")
        suite.add_arguments(p)
    return parser


def _suite_named(argv: Sequence[str], names: Iterable[str]) -> str | None:
    """The suite on the command line: its first argument that is not an option."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return first if first in set(names) else None


def main(
    argv: Sequence[str] | None = None,
    *,
    suites: Mapping[str, Suite] | None = None,
    prog: str = "lab2bench",
    description: str = DESCRIPTION,
    version: str | None = None,
) -> int:
    """Run the command; returns the exit code (also used as the console script).

    ``suites`` (default: every available suite), ``prog``, ``description`` and ``version``
    let another command run its own suites through this runner.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    suites = available_suites() if suites is None else dict(suites)
    named = _suite_named(argv, suites)
    parser = build_parser(suites, options_of=[named] if named else [], prog=prog,
                          description=description, version=version)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "list":
        width = max(len(n) for n in suites)
        for name, suite in suites.items():
            print(f"{name:<{width}}  {suite.help}")
        return 0
    try:
        return int(suites[args.command].run(args) or 0)
    except (ValueError, RuntimeError) as err:
        print(f"{prog} {args.command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
