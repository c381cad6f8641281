#!/usr/bin/env bash
# The multi-GPU tables over NCCL in one call per machine kind: DDP variants, every sharding
# kind and the stacks (eager and compiled) at each world size, preset and per-rank batch,
# each script writing its JSONL and Markdown under OUT_DIR/<script>-<preset>-<ws>x<batch>.
# Scaling: stack.py's tokens/s at world size N over world size 1.
# Usage: multi_gpu.sh OUT_DIR [WORLD_SIZES] [PRESETS] [BATCHES]
#   (defaults "1 2", "small medium xl", "8 32"; 4 and 8 where those kinds are lent)
# CPU smoke run of the plumbing: QUICK=1 multi_gpu.sh OUT_DIR 2
set -euo pipefail
out=${1:?usage: multi_gpu.sh OUT_DIR [WORLD_SIZES] [PRESETS] [BATCHES]}
here=$(dirname "$0")
py=${PYTHON:-python3}  # PYTHON="uv run python" in the workspace
mkdir -p "$out"
presets=${3:-small medium xl} batches=${4:-8 32}
[ "${QUICK:-0}" = 1 ] && presets=micro batches=2
for ws in ${2:-1 2}; do
  for preset in $presets; do
    for batch in $batches; do
      C="--device cuda --world-size $ws --precision bf16 --context-length 512 --vocab-size 10000"
      C="$C --preset $preset --batch-size $batch --rounds 3"
      [ "${QUICK:-0}" = 1 ] && C="--quick --world-size $ws"
      tag="$preset-${ws}x$batch"
      $py "$here/ddp.py" $C --out "$out/ddp-$tag"
      $py "$here/zero.py" $C --out "$out/zero-$tag"
      $py "$here/stack.py" $C --out "$out/stack-$tag"
      $py "$here/stack.py" $C --compile --out "$out/stack-compiled-$tag"
    done
  done
done
