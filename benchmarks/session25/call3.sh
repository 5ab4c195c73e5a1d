#!/usr/bin/env bash
# Session 25, call 3 (carry [".whl", "benchmarks/ab"]; `bash benchmarks/ab_packages.sh after=HEAD before=HEAD~1`
# first): the FP8 down GEMV that sums the pairs itself, bench decode FP8 at B = 1, 2, 4 (the GEMV path), before /
# after, A, B, A, B; then the GPU tests of the FP8 kernels and engine in two lanes.
source benchmarks/device_env.sh
t0=$(date +%s)
AB_TIMEOUT=80
for r in 1 2; do
  ab_decode before fp8_$r --batches 1,2,4 --modes base,active --quantization fp8
  ab_decode after fp8_$r --batches 1,2,4 --modes base,active --quantization fp8
done
LANE_TIMEOUT=150 lane test_kernels_moe_fp8 &
LANE_TIMEOUT=150 lane test_gpu_fp8_engine &
wait
tar -czf $OUT/ab_logs.tgz -C /tmp $(cd /tmp && ls ab_*.log)
echo "done $(( $(date +%s)-t0 ))s"
