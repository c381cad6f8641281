"""Smoke test of an installed lab2bench: a timing, and the norm suite's quick run."""

import tempfile
from pathlib import Path

import torch

import lab2bench
from lab2bench.cli import main

x = torch.randn(256, 256)
stats = lab2bench.measure(lambda: x @ x, warmup=1, repeats=3, device="cpu")
assert stats.median > 0, stats
with tempfile.TemporaryDirectory() as out:
    assert main(["norm", "--quick", "--impl", "torch-naive,F.rms_norm", "--out", out]) == 0
    assert lab2bench.read_records(Path(out) / "norm.jsonl")
print(f"lab2bench {lab2bench.__version__}: measure and `lab2bench norm --quick` ok")
