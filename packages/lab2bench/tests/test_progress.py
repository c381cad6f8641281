"""``lab2bench.progress``: a bar that can advance, a spinner where it cannot."""

from __future__ import annotations

import pytest
from rich.progress import BarColumn, SpinnerColumn

from lab2bench.report import _progress_columns, progress


@pytest.mark.parametrize("total, spinner", [(None, True), (0, True), (1, True), (2, False)])
def test_spinner_where_a_bar_could_not_advance(total, spinner):
    kinds = {type(c) for c in _progress_columns(total)}
    assert (SpinnerColumn in kinds) == spinner
    assert (BarColumn in kinds) == (not spinner)


@pytest.mark.parametrize("items", [[7], [1, 2, 3], iter("ab")])
def test_shown_bar_passes_items_through(items):
    expected = list(items) if isinstance(items, list) else ["a", "b"]
    assert list(progress(items, description="x", disable=False)) == expected
