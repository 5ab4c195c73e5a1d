#!/usr/bin/env bash
# Session 22, call 5: split-K for the FP8 dense Triton GEMM (partials summed in split order by the last program of
# each tile): its GPU tests (determinism across launches), then the dense sweep with split-K candidates at 1-512
# rows against scaled_mm and bf16 cuBLAS.
source benchmarks/device_env.sh
t0=$(date +%s)
LANE_TIMEOUT=90 lane test_kernels_fp8_linear
timeout 400 python3 -m benchmarks.kernels.fp8_moe --out $OUT --parts dense --tokens 1,2,8,16,64,128,256,512 --sweep \
  > $OUT/dense_split.log 2>&1; echo "dense sweep rc=$? $(( $(date +%s)-t0 ))s"
grep -E "^dense|sweep fp8_w|split " $OUT/dense_split.log | cut -c1-330
