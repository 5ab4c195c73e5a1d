#!/usr/bin/env bash
# Session 29 call 7: GPU tests of the v1 package (call 6) that its changes touch, three lanes at once.
source benchmarks/device_env.sh; t0=$(date +%s); cd benchmarks/ab/v1
export OUT_REAL=$OUT OUT=/tmp/lanes LANE_TIMEOUT=230; mkdir -p /tmp/lanes
(lane test_gpu_engine > /tmp/lanes/A.txt) &
(lane test_gpu_fp8_engine test_kernels_moe_fp8 > /tmp/lanes/B.txt) &
(lane test_kernels_moe test_kernels_gemv test_pdl_launches > /tmp/lanes/C.txt) &
wait; cat /tmp/lanes/[ABC].txt; tar -czf $OUT_REAL/lanes_v1.tgz -C /tmp lanes; echo "tests $(( $(date +%s)-t0 ))s"
