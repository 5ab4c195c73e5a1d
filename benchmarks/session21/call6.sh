#!/usr/bin/env bash
# Session 21, call 6: the FP8 dense 16 x 32 tiles at 2 rows, where the kernel sweep put q|k|v at 2x (19.6 -> 8.9 us):
# FP8 decode at B = 2 (base, active), before (9e38ee0's package in ab_old/, untracked) and after, alternated.
source benchmarks/device_env.sh
t0=$(date +%s)
for round in 1 2; do
  for v in old new; do
    path=$([ $v = old ] && echo /tmp/site:benchmarks/session21/ab_old || echo /tmp/site:.)
    PYTHONPATH=$path timeout 60 python3 -m moeserve.bench.decode --layers 48 --batches 2 --modes base,active \
      --steps 32 --repeats 1 --quantization fp8 --out /tmp/ab_$v$round > $OUT/fp8_b2_${v}_$round.log 2>&1
    echo "$v round $round rc=$? $(( $(date +%s)-t0 ))s: $(grep -E '^ +2 ' $OUT/fp8_b2_${v}_$round.log | tr -s ' ')"
  done
done
