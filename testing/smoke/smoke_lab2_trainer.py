"""Smoke test of an installed lab2-trainer: ``lab2-train`` trains a one-layer model for three
steps on one CPU rank, on a small text file, and writes its run folder."""

import json
import math
import random
import tempfile
from pathlib import Path

from lab2_trainer import __version__
from lab2_trainer.cli.main import main

with tempfile.TemporaryDirectory() as tmp:
    words = ["alpha", "beta", "gamma", "delta", "tensor", "norm", "rank", "bucket", "shard"]
    corpus = Path(tmp) / "corpus.txt"
    corpus.write_text(" ".join(random.Random(0).choice(words) for _ in range(6000)))
    out = Path(tmp) / "run"
    code = main(["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--d-ff", "64",
                 "--context-length", "32", "--nproc", "1", "--device", "cpu", "--steps", "3",
                 "--batch-size", "4", "--eval-every", "3", "--eval-batches", "1",
                 "--sample-tokens", "16", "--data", str(corpus), "--out", str(out),
                 "--no-plot", "--quiet"])
    assert code == 0, code
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and math.isfinite(summary["final_val_loss"]), summary
print(f"lab2-trainer {__version__}: a three-step run on one CPU rank ok")
