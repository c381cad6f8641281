#!/usr/bin/env bash
# Every --sharding kind on one H200, world size 1, then MFU of the compiled stack at xl
# (the zero1 README's GPU figures). Usage: h200_sharding.sh OUT_DIR
set -euo pipefail
out=${1:?usage: h200_sharding.sh OUT_DIR}
here=$(dirname "$0")
py=${PYTHON:-python3}  # PYTHON="uv run python" in the workspace
mkdir -p "$out"
C="--device cuda --world-size 1 --precision bf16 --context-length 512 --vocab-size 10000"
# Eager, medium, 8 x 512: every stack of stack.py, 3 interleaved rounds.
$py "$here/stack.py" $C --preset medium --batch-size 8 --warmup 3 --steps 15 --rounds 3 \
    --out "$out/stack-medium" 2>&1 | grep -v "^  \[rank"
# Memory and bytes of every kind (one rank: nothing is sent).
$py "$here/zero.py" $C --preset medium --batch-size 8 --warmup 1 --steps 5 --rounds 1 \
    --out "$out/zero-medium" 2>&1 | grep -v "^  \[rank"
# Compiled, xl, 32 x 512: the trainer's default stack and the earlier all-reduce pairing.
for stack in ours ours-allreduce ours-zero3 ours-fsdp; do
    $py "$here/mfu.py" --configs xl:32x512 --stack $stack
done
# Compiled, xl, 32 x 512: zero3 beside FSDP2 in one run, interleaved (MFU per variant).
$py "$here/stack.py" --device cuda --world-size 1 --precision bf16 --preset xl \
    --batch-size 32 --context-length 512 --compile --variants ours-zero3,ours-fsdp \
    --warmup 3 --steps 10 --rounds 3 --out "$out/stack-xl-zero3" 2>&1 | grep -v "^  \[rank"
