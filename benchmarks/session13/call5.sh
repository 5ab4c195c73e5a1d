#!/usr/bin/env bash
# Session 13, last call, on the final tree (carry .whl): every GPU test file in four lanes (memory fit after), then
# the serving protocol's base and adapter traffic through `moeserve serve` (the pipelined engine with the faster
# batch preparation and the torch-free HTTP process). Each step under its own limit.
source benchmarks/device_env.sh
t0=$(date +%s)
LANE_TIMEOUT=200 lane test_gpu_first_request &
LANE_TIMEOUT=150 lane test_kernels_moe test_kernels_moe_gate_up test_kernels_attention_lora &
LANE_TIMEOUT=150 lane test_gpu_engine test_prefix_cache test_router_lora test_kernels_norm_rotary test_layer_profile &
LANE_TIMEOUT=150 lane test_kernels_moe_fp8 test_kernels_fp8_quant test_kernels_fp8_linear test_gpu_fp8_engine \
  test_kernels_router test_kernels_gemv &
wait
LANE_TIMEOUT=60 lane test_memory_fit
grep -h -A6 "^FAILED\|^ERROR" $OUT/test_*.log | head -40 | cut -c1-300
echo "== tests done at $(( $(date +%s)-t0 )) s"
left=$(( 500 - $(date +%s) + t0 ))
[ $left -gt 60 ] && timeout $left python3 -m moeserve.bench.protocol --parts cold --out $OUT/cold 2>&1 \
  | grep -E "server up|compiled|run |cold-" | tail -7
cp $OUT/cold/protocol.json $OUT/serve_protocol.json 2>/dev/null; rm -rf $OUT/cold
echo "== serve done at $(( $(date +%s)-t0 )) s"
