#!/usr/bin/env bash
# Session 26 call 3: the merged tree (bf16 GEMV and FP8 dense GEMV without exchange, FP8 512-token row in plain
# block order): its GPU tests on the hot path, then the real server FP8 and bf16 (`bench protocol --parts cold`).
source benchmarks/device_env.sh
t0=$(date +%s)
LANE_TIMEOUT=120 lane test_kernels_gemv test_kernels_fp8_linear test_kernels_moe_fp8 test_gpu_fp8_engine
timeout 230 python3 -m moeserve.bench.protocol --parts cold --out /tmp/cold_fp8 \
  --server-args "--quantization fp8" > $OUT/protocol_fp8.log 2>&1
echo "protocol fp8 rc=$? $(( $(date +%s)-t0 ))s"; grep -E "^run |^cold-" $OUT/protocol_fp8.log | tail -4
timeout $(( 570 - ($(date +%s)-t0) )) python3 -m moeserve.bench.protocol --parts cold --out /tmp/cold_bf16 \
  > $OUT/protocol_bf16.log 2>&1
echo "protocol bf16 rc=$? $(( $(date +%s)-t0 ))s"; grep -E "^run |^cold-" $OUT/protocol_bf16.log | tail -4
cp /tmp/cold_fp8/protocol.json $OUT/protocol_fp8.json 2>/dev/null; cp /tmp/cold_bf16/protocol.json $OUT/protocol_bf16.json 2>/dev/null
echo "done $(( $(date +%s)-t0 ))s"
