"""What rank 0 prints: unwrapped lines off a terminal, the sample as escaped text, the
summary's wording, a spinner where the bar could not advance."""

from __future__ import annotations

import pytest
from rich.progress import BarColumn, SpinnerColumn

from lab2_trainer.reporting.report import RunReporter, bytes_as_text, ratio_text


def test_sample_text_escapes_undecodable_bytes_and_controls():
    data = "naïve\tok\n".encode() + b"\xff\xfe" + b"\x1b[31mred\r" + "é".encode()[:1]
    assert bytes_as_text(data) == "naïve\tok\n\\xff\\xfe\\x1b[31mred\\r\\xc3"


@pytest.mark.parametrize("ratio, text", [
    (0.323, "0.323 (67.7% below the unigram entropy)"),
    (1.677, "1.677 (67.7% above the unigram entropy)"),
    (1.0, "1.000 (equal to the unigram entropy)"),
])
def test_ratio_wording(ratio, text):
    assert ratio_text(ratio) == text


def _summary(reporter: RunReporter, out) -> None:
    reporter.summary({"final_val_loss": 1.5, "unigram_entropy": 3.0, "steps": 2, "tokens": 512,
                      "train_seconds": 1.0, "tokens_per_s": 512.0, "setup": "1 rank(s)"},
                     {"metrics": str(out / ("deep-folder-name/" * 8) / "metrics.jsonl")})


def test_no_wrapping_off_a_terminal(tmp_path, capsys):
    reporter = RunReporter(tmp_path, 10, 0, quiet=False, log_every=1)
    long_line = "word " * 40
    reporter.print(long_line)
    _summary(reporter, tmp_path)
    reporter.close()
    printed = capsys.readouterr().out
    assert long_line.rstrip() in printed.splitlines()[0]
    assert str(tmp_path / ("deep-folder-name/" * 8) / "metrics.jsonl") in printed
    assert "…" not in printed
    assert "50.0% below the unigram entropy" in printed


@pytest.mark.parametrize("total, start, spinner", [(10, 0, False), (1, 0, True), (10, 9, True)])
def test_spinner_when_the_bar_could_not_advance(tmp_path, monkeypatch, total, start, spinner):
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich: a terminal, so the bar is shown
    reporter = RunReporter(tmp_path, total, start, quiet=False, log_every=1)
    try:
        assert reporter.progress is not None
        kinds = {type(c) for c in reporter.progress.columns}
        assert (SpinnerColumn in kinds) == spinner
        assert (BarColumn in kinds) == (not spinner)
    finally:
        reporter.close()
