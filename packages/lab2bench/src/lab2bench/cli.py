"""The ``lab2bench`` command: ``lab2bench <suite> [--quick] [--out DIR] [--device D] ...``.

``lab2bench list`` shows the suites; ``lab2bench <suite> --help`` its options.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lab2bench import __version__
from lab2bench.suites import available_suites


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, one subcommand per suite plus ``list``."""
    parser = argparse.ArgumentParser(
        prog="lab2bench",
        description="Benchmarks for PyTorch code: each suite prints a Markdown table, and "
                    "with --out writes JSON lines, the table and PNG plots.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="SUITE")
    sub.add_parser("list", help="list the suites")
    for suite in available_suites().values():
        p = sub.add_parser(suite.name, help=suite.help, description=suite.help)
        p.add_argument("--quick", action="store_true",
                       help="tiny shapes on the CPU, done in seconds (a smoke test)")
        p.add_argument("--out", metavar="DIR", default=None,
                       help="write <suite>.jsonl (appended), <suite>.md and PNG plots here")
        p.add_argument("--device", default=None,
                       help="cpu, cuda or cuda:N (default: CUDA if available; cpu with --quick)")
        suite.add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit code (also used as the console script)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    suites = available_suites()
    if args.command == "list":
        width = max(len(n) for n in suites)
        for name, suite in suites.items():
            print(f"{name:<{width}}  {suite.help}")
        return 0
    try:
        return int(suites[args.command].run(args) or 0)
    except (ValueError, RuntimeError) as err:
        print(f"lab2bench {args.command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
