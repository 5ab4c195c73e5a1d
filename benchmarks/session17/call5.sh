#!/usr/bin/env bash
# Call 5 (the final tree: the MoE LoRA one way, the walk in place): GPU tests of the files the session changed or
# reaches — the MoE kernels (bf16, gate/up halves, FP8), the FP8 and bf16 engines (graphs vs eager, nolora graph
# bitwise the LoRA-disabled engine, mixed adapter batches), and the first request's served shape (the warm-up
# compiles every variant the server then runs).
source benchmarks/device_env.sh
t0=$(date +%s)
LANE_TIMEOUT=120 lane test_kernels_moe
LANE_TIMEOUT=60 lane test_kernels_moe_gate_up test_kernels_moe_fp8
LANE_TIMEOUT=100 lane test_gpu_fp8_engine test_gpu_engine
timeout 70 python3 -m pytest -q -m gpu tests/test_gpu_first_request.py -k served_shape -rf --tb=short \
  -p no:cacheprovider > $OUT/test_gpu_first_request_served_shape.log 2>&1
echo "served_shape rc=$? $(( $(date +%s)-t0 ))s: $(tail -n 1 $OUT/test_gpu_first_request_served_shape.log)"
echo "done at $(( $(date +%s)-t0 )) s"
