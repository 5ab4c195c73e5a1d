#!/bin/bash
# Old tree, new tree, old, new: each one process of benchmarks/cpu_demo_vs_transformers.py (engine and
# transformers alternated inside it, 2 rounds). OLD_ROOT: an unpacked archive of the old tree (git archive).
#   OLD_ROOT=/tmp/old bash benchmarks/cpu_demo_2026-12-01/ab_trees.sh 2   # threads
T=${1:-2}
NEW_ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=$(dirname "$0")/logs
export OMP_NUM_THREADS=$T
for i in 1 2; do
  for tree in old new; do
    if [ $tree = old ]; then root=$OLD_ROOT; else root=$NEW_ROOT; fi
    echo "== $tree run $i threads $T load $(cat /proc/loadavg)"
    PYTHONPATH=$root python "$NEW_ROOT/benchmarks/cpu_demo_vs_transformers.py" --rounds 2 \
      --out "$OUT/${tree}_t${T}_$i.json" 2>&1 | grep -E "^\| |equal"
  done
done
