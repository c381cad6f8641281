"""Showing results: Markdown tables, PNG plots of sweeps, progress bars."""

from __future__ import annotations

import io
import math
import numbers
import os
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from lab2bench.records import atomic_write_bytes

T = TypeVar("T")


def _format_cell(value: Any, fmt: str) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        v = float(value)
        if math.isnan(v):
            return "nan"
        return format(v, fmt)
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str] | None = None,
    floatfmt: str | Mapping[str, str] = ".3g",
    *,
    headers: Mapping[str, str] | None = None,
) -> str:
    """Render dicts as a GitHub Markdown table.

    Numbers are right-aligned, text left-aligned; a missing key or None gives an
    empty cell; ``|`` inside text is escaped.

    Args:
        rows: one dict per row.
        columns: the keys to show, in order (default: every key, in order of first
            appearance).
        floatfmt: a format spec for floats (``".3f"``, ``".1%"``...), or a mapping from
            column to spec (columns not in it use ``".3g"``). Integers print as they are.
        headers: display names for some columns (default: the keys themselves).

    Returns:
        The table, lines joined by ``\\n``, with a trailing newline.
    """
    if columns is None:
        cols: list[str] = []
        for row in rows:
            cols.extend(k for k in row if k not in cols)
    else:
        cols = list(columns)
    if not cols:
        raise ValueError("markdown_table: no columns (empty rows and no columns given)")
    headers = dict(headers or {})

    def spec(col: str) -> str:
        if isinstance(floatfmt, str):
            return floatfmt
        return floatfmt.get(col, ".3g")

    numeric = {
        c: any(r.get(c) is not None for r in rows)
        and all(r.get(c) is None or (isinstance(r.get(c), numbers.Real)
                                     and not isinstance(r.get(c), bool)) for r in rows)
        for c in cols
    }
    lines = ["| " + " | ".join(headers.get(c, c) for c in cols) + " |"]
    lines.append("|" + "|".join("---:" if numeric[c] else "---" for c in cols) + "|")
    for row in rows:
        lines.append("| " + " | ".join(_format_cell(row.get(c), spec(c)) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def plot_sweep(
    rows: Sequence[Mapping[str, Any]],
    *,
    x: str,
    y: str,
    series: str | Sequence[str] | None,
    path: str | os.PathLike[str],
    title: str | None = None,
    logx: bool = False,
    xlabel: str | None = None,
    ylabel: str | None = None,
) -> Path:
    """Plot ``y`` against ``x``, one line per ``series`` value, to a PNG file.

    Rows missing ``x`` or ``y`` (or holding None there) are left out. The file is
    written atomically; no global matplotlib state is touched (Agg canvas).

    Args:
        rows: the measurements, one dict each.
        x: key of the x value (numbers).
        y: key of the y value (numbers).
        series: key (or keys, joined in the label) splitting the rows into lines;
            None for a single line.
        path: the PNG to write (folders are created).
        title: the figure's title.
        logx: log scale on x (base 2 when every x is a power of two).
        xlabel: x axis label (default: ``x``).
        ylabel: y axis label (default: ``y``).

    Returns:
        The path written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    keys = [] if series is None else [series] if isinstance(series, str) else list(series)
    groups: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        xv, yv = row.get(x), row.get(y)
        if xv is None or yv is None:
            continue
        label = ", ".join(f"{row.get(k)}" for k in keys) if keys else y
        groups.setdefault(label, []).append((float(xv), float(yv)))
    if not groups:
        raise ValueError(f"plot_sweep: no row has both {x!r} and {y!r}")

    fig = Figure(figsize=(7.5, 4.8), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for label, points in groups.items():
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    if logx:
        xs = [p[0] for pts in groups.values() for p in pts]
        powers_of_two = all(v > 0 and float(v).is_integer() and int(v) & (int(v) - 1) == 0
                            for v in xs)
        ax.set_xscale("log", base=2 if powers_of_two else 10)
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel(ylabel or y)
    if title:
        ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    if keys or len(groups) > 1:
        ax.legend(fontsize="small", title=", ".join(keys) if keys else None)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return atomic_write_bytes(path, buf.getvalue())


def progress(
    items: Iterable[T],
    *,
    description: str = "",
    total: int | None = None,
    disable: bool | None = None,
) -> Iterator[T]:
    """Iterate over ``items`` with a rich progress bar on stderr.

    A bar that could not advance before the end (one item, or an unknown number) is a
    spinner instead, rather than a bar at 0% for the whole time.

    Args:
        items: what to iterate over.
        description: text shown beside the bar.
        total: number of items, when ``items`` has no ``len``.
        disable: True for no bar; None (default) shows one only when stderr is a terminal.
    """
    if disable is None:
        disable = not sys.stderr.isatty()
    if disable:
        yield from items
        return
    from rich.console import Console
    from rich.progress import Progress

    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with Progress(*_progress_columns(total), console=Console(stderr=True),
                  transient=True) as bar:
        yield from bar.track(items, total=total, description=description)


def _progress_columns(total: int | None) -> list[Any]:
    """Rich's default columns (description, bar, percentage, time left) for ``total`` items;
    description, spinner and elapsed time where a bar could not advance."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    if total is None or total <= 1:
        return [TextColumn("[progress.description]{task.description}"), SpinnerColumn(),
                TimeElapsedColumn()]
    return list(Progress.get_default_columns())
