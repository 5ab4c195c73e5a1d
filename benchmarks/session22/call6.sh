#!/usr/bin/env bash
# Session 22, call 6: the split-K FP8 dense GEMM in the engine (linear_split: decode rows on 16 x 32 tiles in 2-4
# splits; o_proj's long K on 64 x 64 tiles, W8A8, up to 128 rows, in place of scaled_mm). GPU tests, then decode
# A/B (ab_main: HEAD before it; ab_split: with it; each side from inside its own package directory), FP8 at
# B = 1, 2, 8 (base, active) and 64, 128, 256 (base); bf16 at B = 1, 8, 64 for the ratio.
source benchmarks/device_env.sh
t0=$(date +%s)
root=$PWD
LANE_TIMEOUT=60 lane test_kernels_fp8_linear
LANE_TIMEOUT=130 lane test_gpu_fp8_engine
ab() {  # $1 variant, $2 label, then the decode arguments
  local v=$1 label=$2; shift 2
  (cd $root/benchmarks/session22/ab_$v && PYTHONPATH=/tmp/site timeout 30 python3 -c \
    "import moeserve; print('package', moeserve.__file__)" && PYTHONPATH=/tmp/site timeout 80 python3 -m \
    moeserve.bench.decode --layers 48 --steps 32 --repeats 1 --out /tmp/ab_$v$label "$@") > /tmp/ab_${v}_$label.log 2>&1
  echo "$v $label rc=$? $(( $(date +%s)-t0 ))s: $(grep -E '^package|^ +[0-9]+ ' /tmp/ab_${v}_$label.log | tr -s ' ' | tr '\n' '|')"; }
for round in 1 2; do
  for v in main split; do ab $v small_$round --batches 1,2,8 --modes base,active --quantization fp8; done
  for v in main split; do ab $v large_$round --batches 64,128,256 --modes base --quantization fp8; done
done
ab main bf16 --batches 1,8,64 --modes base
tar -czf $OUT/ab_logs.tgz -C /tmp $(cd /tmp && ls ab_*.log)
echo "done $(( $(date +%s)-t0 ))s"
