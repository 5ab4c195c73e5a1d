#!/usr/bin/env bash
# Session 25, call 3 (carry [".whl", "benchmarks/ab"]; `bash benchmarks/ab_packages.sh after=HEAD before=aedebc2`
# first): the decode down GEMVs that sum a token's pairs themselves (no top-k sum launch). First the GPU tests of
# the MoE kernels, both engines and the first request (no compile after the warm-up) in three lanes (the device
# time left may not cover both parts: tests first); then bench decode at B = 1, 2, 4 (the GEMV path), FP8 and
# bf16, before / after.
source benchmarks/device_env.sh
t0=$(date +%s)
(LANE_TIMEOUT=150 lane test_kernels_moe; LANE_TIMEOUT=90 lane test_kernels_moe_fp8) &
(LANE_TIMEOUT=120 lane test_gpu_fp8_engine; LANE_TIMEOUT=120 lane test_gpu_engine) &
LANE_TIMEOUT=230 lane test_gpu_first_request &
wait
echo "tests $(( $(date +%s)-t0 ))s"
AB_TIMEOUT=75
for q in "--quantization fp8" ""; do
  label=$([ -n "$q" ] && echo fp8 || echo bf16)
  ab_decode before $label --batches 1,2,4 --modes base,active $q
  ab_decode after $label --batches 1,2,4 --modes base,active $q
  tar -czf $OUT/ab_logs.tgz -C /tmp $(cd /tmp && ls ab_*.log)
done
echo "done $(( $(date +%s)-t0 ))s"
