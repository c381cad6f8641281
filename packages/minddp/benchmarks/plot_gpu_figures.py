"""Draw the two plots of the record docs/benchmarks/2026-11-30-2xh200-nccl.md from the
figures measured on 2 x H200 on 2026-11-30 (copied from that record's tables). To redraw:

    uv run python packages/minddp/benchmarks/plot_gpu_figures.py
"""

from __future__ import annotations

from pathlib import Path

from lab2bench import plot_sweep

RECORD_DIR = Path(__file__).parents[1] / "docs" / "benchmarks"

# Bucket sweep, medium preset, 32 x 512 tokens per GPU (2 x H200, recorded 2026-11-30 06:31 UTC):
# cap MB -> step ms.
SWEEP = {1: 133, 5: 146, 10: 141, 25: 134, 50: 116, 100: 115, 500: 116}
TORCH_25MB_MS = 121

# 2 x H200, recorded 2026-11-30 07:41 UTC: preset (parameters, millions) -> step time /
# PyTorch DDP's, 25 and 100 MB.
RATIO = {"small 64x512": (129, 1.00, 0.98), "medium 32x512": (424, 1.14, 0.99),
         "large 32x512": (970, 1.02, 0.98), "xl 16x512": (2000, 0.99, 0.98),
         "2.7B 16x512": (2700, 0.99, 0.99)}


def main() -> None:
    rows = [{"bucket_mb": mb, "step_ms": ms, "variant": "DDPBucketed"} for mb, ms in SWEEP.items()]
    rows += [{"bucket_mb": mb, "step_ms": TORCH_25MB_MS, "variant": "PyTorch DDP, 25 MB"}
             for mb in (1, 500)]
    plot_sweep(rows, x="bucket_mb", y="step_ms", series="variant", logx=True,
               path=RECORD_DIR / "bucket_sweep_medium.png",
               title="medium (424M), 32 x 512 tokens per GPU, 2 x H200: step time vs bucket cap",
               xlabel="bucket cap (MB)", ylabel="step ms (mean, slowest rank)")
    rows = [{"params_M": p, "ratio": r, "bucket": f"DDPBucketed {mb} MB"}
            for p, r25, r100 in RATIO.values() for mb, r in ((25, r25), (100, r100))]
    rows += [{"params_M": p, "ratio": 1.0, "bucket": "PyTorch DDP"} for p, *_ in RATIO.values()]
    plot_sweep(rows, x="params_M", y="ratio", series="bucket", logx=True,
               path=RECORD_DIR / "ratio_by_preset.png",
               title="step time / PyTorch DDP's, 2 x H200, bf16 (small to 2.7B)",
               xlabel="parameters (millions)", ylabel="x PyTorch DDP")


if __name__ == "__main__":
    main()
