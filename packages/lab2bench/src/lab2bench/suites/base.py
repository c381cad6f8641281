"""What a benchmark suite is, and the shared plumbing of the ``lab2bench`` command."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab2bench.records import atomic_write_text
from lab2bench.report import markdown_table


@dataclass(frozen=True)
class Suite:
    """A benchmark the ``lab2bench`` command can run.

    Every suite's subcommand gets the common options ``--quick`` (tiny, CPU, seconds),
    ``--out DIR`` (write ``<name>.jsonl``, ``<name>.md`` and PNG plots there) and
    ``--device``; ``add_arguments`` adds the suite's own.

    ``lab2bench --help`` imports every suite's module (an entry point's), and
    ``lab2bench <name> --help`` calls its ``add_arguments``, so neither may import torch
    (or anything as slow): import it in ``run``.

    Attributes:
        name: the subcommand (``lab2bench <name>``).
        help: one line for ``lab2bench list`` and ``--help``.
        add_arguments: adds the suite's options to its ``argparse`` subparser.
        run: runs the suite with the parsed arguments; returns the exit code.
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def comma_list(convert: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """An argparse ``type`` for comma-separated values (``--hidden 1024,2048``)."""

    def parse(text: str) -> list[Any]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"empty list: {text!r}")
        try:
            return [convert(t) for t in items]
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return parse


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"expected a positive integer, got {text}")
    return value


def write_markdown_report(
    out_dir: str | Path,
    name: str,
    *,
    title: str,
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str],
    headers: Mapping[str, str] | None = None,
    floatfmt: str | Mapping[str, str] = ".3g",
    preamble: Sequence[str] = (),
    notes: Sequence[str] = (),
) -> Path:
    """Write ``<out_dir>/<name>.md``: a title, preamble lines, the table, notes."""
    parts = [f"# {title}", ""]
    parts += [*preamble, ""] if preamble else []
    parts.append(markdown_table(rows, columns, floatfmt, headers=headers) if rows
                 else "(no measurements)\n")
    if notes:
        parts += ["Notes:", ""] + [f"- {n}" for n in notes] + [""]
    return atomic_write_text(Path(out_dir) / f"{name}.md", "\n".join(parts))


def show_report(
    out_dir: str | Path | None,
    name: str,
    *,
    title: str,
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str],
    headers: Mapping[str, str] | None = None,
    floatfmt: str | Mapping[str, str] = ".3g",
    preamble: Sequence[str] = (),
    notes: Sequence[str] = (),
) -> Path | None:
    """Print the preamble, the table and the notes; with ``out_dir``, also write them to
    ``<out_dir>/<name>.md`` (``write_markdown_report``) and return that path."""
    print("\n".join(preamble))
    print()
    print(markdown_table(rows, columns, floatfmt, headers=headers) if rows
          else "(no measurements)")
    for note in notes:
        print(f"note: {note}")
    if out_dir is None:
        return None
    return write_markdown_report(out_dir, name, title=title, rows=rows, columns=columns,
                                 headers=headers, floatfmt=floatfmt, preamble=preamble,
                                 notes=notes)
