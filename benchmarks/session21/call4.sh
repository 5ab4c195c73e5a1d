#!/usr/bin/env bash
# Session 21, call 4: the FP8 dense projections on 16 x 32 tiles at decode sizes (GEMV only for one row with K > N)
# against the tree before (the package at 9e38ee0, extracted into ab_old/, untracked), FP8 decode at B = 1 and 8,
# alternated; then the GPU tests of what this session touched (FP8 linear, the FP8 engine, the MoE kernels with the
# table's LoRA shrink options, the engine).
source benchmarks/device_env.sh
t0=$(date +%s)
for round in 1 2; do
  for v in old new; do
    path=$([ $v = old ] && echo /tmp/site:benchmarks/session21/ab_old || echo /tmp/site:.)
    PYTHONPATH=$path timeout 70 python3 -m moeserve.bench.decode --layers 48 --batches 1,8 --modes base,active \
      --steps 32 --repeats 1 --quantization fp8 --out /tmp/ab_$v$round > $OUT/fp8_${v}_$round.log 2>&1
    echo "$v round $round rc=$? $(( $(date +%s)-t0 ))s: $(grep -E '^ +(1|8) ' $OUT/fp8_${v}_$round.log | tr -s ' ' | tr '\n' '|')"
  done
done
LANE_TIMEOUT=60 lane test_kernels_fp8_linear
LANE_TIMEOUT=100 lane test_gpu_fp8_engine
LANE_TIMEOUT=$(( 575 - ($(date +%s)-t0) - 130 )) lane test_kernels_moe
LANE_TIMEOUT=$(( 580 - ($(date +%s)-t0) )) lane test_gpu_engine
echo "done $(( $(date +%s)-t0 ))s"
