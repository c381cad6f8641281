"""Smoke test of an installed lab2bench: a timing, and the comm suite's quick run (an
all-reduce over Gloo between two local ranks on the CPU)."""

import tempfile
from pathlib import Path

import torch

import lab2bench
from lab2bench.cli import main

# The ranks start from a forkserver, which imports this script again: run under the guard.
if __name__ == "__main__":
    x = torch.randn(256, 256)
    stats = lab2bench.measure(lambda: x @ x, warmup=1, repeats=3, device="cpu")
    assert stats.median > 0, stats
    with tempfile.TemporaryDirectory() as out:
        assert main(["comm", "--quick", "--sizes", "4KB", "--repeats", "3", "--timeout", "120",
                     "--out", out]) == 0
        records = lab2bench.read_records(Path(out) / "comm.jsonl")
        assert records and all(r["metrics"]["status"] == "ok" for r in records), records
    print(f"lab2bench {lab2bench.__version__}: measure and `lab2bench comm --quick` ok")
