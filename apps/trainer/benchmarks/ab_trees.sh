#!/usr/bin/env bash
# The training step of one configuration in two source trees, this one (or NEW) and BASE
# (a checkout of an earlier commit), each run in a fresh process on its own PYTHONPATH, in the order
# A B B A per round: a change's cost at the step, with each tree measured twice a round as
# its own control. Each run is `mfu.py --configs CONFIG --windows WINDOWS` (one GPU, bf16,
# compiled by default, the trainer's default stack); the tokens/s of every run go to OUT.
#
#   BASE=../lab2-old CONFIG=xl:32x512 ROUNDS=2 OUT=runs/ab apps/trainer/benchmarks/ab_trees.sh
#   (EXTRA="--device cpu" CONFIG=tiny:2x64 ROUNDS=1: a smoke run on the CPU)
set -euo pipefail
here="$(cd "${NEW:-$(dirname "$0")/../../..}" && pwd)"
base="$(cd "${BASE:?BASE: a checkout of the commit to compare with}" && pwd)"
config="${CONFIG:-xl:32x512}"
rounds="${ROUNDS:-2}"
windows="${WINDOWS:-5}"
out="${OUT:-runs/ab_trees}"
python="${PYTHON:-python3}"
mkdir -p "$out"

run() {  # run TREE NAME: one fresh process of mfu.py from TREE
    local tree="$1" name="$2" path
    path="$(printf '%s:' "$tree"/packages/*/src)$tree/apps/trainer/src"
    PYTHONPATH="$path" "$python" "$tree/apps/trainer/benchmarks/mfu.py" --configs "$config" \
        --windows "$windows" --out "$out/$name" ${EXTRA:-} > "$out/$name.log" 2>&1
    tail -1 "$out/$name/mfu.jsonl" | "$python" -c "import json, sys; \
m = json.loads(sys.stdin.read())['metrics']; \
print('$name', round(m['tokens_per_s']), round(m['step_ms'], 3), m['windows_ms'])"
}

for i in $(seq 1 "$rounds"); do
    run "$here" "new-$i-a"
    run "$base" "base-$i-a"
    run "$base" "base-$i-b"
    run "$here" "new-$i-b"
done | tee "$out/summary.txt"
