#!/usr/bin/env bash
# Session 22, call 7: the final tree (split-K FP8 dense up to 64 rows; ab_split = the working tree, run from inside
# its package directory): the FP8 linear GPU tests, then decode bf16 / FP8 alternated (A, B, A, B) at B = 1, 8, 64,
# 256 (base).
source benchmarks/device_env.sh
t0=$(date +%s)
root=$PWD
LANE_TIMEOUT=60 lane test_kernels_fp8_linear
dec() {  # $1 label, then the decode arguments
  local label=$1; shift
  (cd $root/benchmarks/session22/ab_split && PYTHONPATH=/tmp/site timeout 30 python3 -c \
    "import moeserve; print('package', moeserve.__file__)" && PYTHONPATH=/tmp/site timeout 90 python3 -m \
    moeserve.bench.decode --layers 48 --steps 32 --repeats 1 --out /tmp/dec_$label "$@") > /tmp/dec_$label.log 2>&1
  echo "$label rc=$? $(( $(date +%s)-t0 ))s: $(grep -E '^package|^ +[0-9]+ ' /tmp/dec_$label.log | tr -s ' ' | tr '\n' '|')"; }
for round in 1 2; do
  dec bf16_$round --batches 1,8,64,256 --modes base
  dec fp8_$round --batches 1,8,64,256 --modes base --quantization fp8
done

tar -czf $OUT/dec_logs.tgz -C /tmp $(cd /tmp && ls dec_*.log)
echo "done $(( $(date +%s)-t0 ))s"
