"""Where a suite's results go: one JSON line per row (``Recorder``), Markdown tables on
stdout and in ``<out>/<suite>.md``, and PNG plots of sweeps.

A suite may write its results itself (``Recorder``, ``show_report``); ``SuiteOutput``
collects them as rows and writes all three kinds at the end.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


class SuiteOutput:
    """Collects one suite's rows and writes them out.

    Args:
        suite: the suite's name (the JSONL record's ``suite`` and the file stem).
        out_dir: folder for ``<suite>.jsonl``, ``<suite>.md`` and plots; None prints only.
    """

    def __init__(self, suite: str, out_dir: str | os.PathLike[str] | None) -> None:
        self.suite = suite
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.rows: list[dict[str, Any]] = []
        self.tables: list[str] = []
        self._config_keys: list[list[str]] = []
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)

    @property
    def jsonl_path(self) -> Path | None:
        return self.out_dir / f"{self.suite}.jsonl" if self.out_dir is not None else None

    def add(self, config: dict[str, Any], metrics: dict[str, Any]) -> dict[str, Any]:
        """Keep one measurement (configuration and figures) as a row.

        Rows are recorded to the JSONL file by :meth:`finish`, so that figures derived
        across rows (speed-ups, ratios) added to a row later are recorded too.
        """
        row = {**config, **metrics}
        self.rows.append(row)
        self._config_keys.append(list(config))
        return row

    def table(self, columns: list[str], *, title: str | None = None,
              rows: list[dict[str, Any]] | None = None,
              floatfmt: str | dict[str, str] = ".3g") -> str:
        """Print a Markdown table of ``rows`` (default: every row) and keep it for the .md file.

        ``floatfmt``: a format spec for floats, or one per column (others ``.3g``)."""
        from lab2bench.report import markdown_table

        rows = self.rows if rows is None else rows
        text = markdown_table(rows, columns, floatfmt)
        if title:
            text = f"### {title}\n\n{text}"
        print(text, flush=True)
        self.tables.append(text)
        return text

    def note(self, text: str) -> None:
        """A paragraph printed and kept in the .md file (how a figure was measured)."""
        print(text, flush=True)
        self.tables.append(text)

    def plot(self, name: str, *, x: str, y: str, series: str | None,
             rows: list[dict[str, Any]] | None = None, logx: bool = False) -> Path | None:
        """A PNG of ``y`` against ``x`` per ``series`` (skipped without an output folder)."""
        if self.out_dir is None:
            return None
        from lab2bench.report import plot_sweep

        rows = self.rows if rows is None else rows
        usable = [r for r in rows if r.get(x) is not None and r.get(y) is not None]
        if not usable:
            return None
        path = self.out_dir / f"{self.suite}-{name}.png"
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            # A machine without matplotlib still gets its tables and records.
            print(f"[bench {self.suite}] matplotlib is not installed: {path.name} not drawn",
                  flush=True)
            return None
        plot_sweep(usable, x=x, y=y, series=series, path=path, logx=logx,
                   title=f"{self.suite}: {y} vs {x}")
        return path

    def finish(self) -> None:
        """Record every row (one JSON line each) and write ``<suite>.md``."""
        if self.out_dir is None:
            return
        from lab2bench.records import Recorder

        recorder = Recorder(self.out_dir / f"{self.suite}.jsonl")
        for row, keys in zip(self.rows, self._config_keys):
            config = {k: row[k] for k in keys}
            metrics = {k: v for k, v in row.items() if k not in config}
            recorder.record(self.suite, config, metrics)
        if self.tables:
            from lab2bench.records import atomic_write_text

            atomic_write_text(self.out_dir / f"{self.suite}.md", "\n\n".join(self.tables) + "\n")

