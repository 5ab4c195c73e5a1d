#!/usr/bin/env bash
# Session 30 call 2: every GPU-marked test of main ab3dad2 (session 29 merged its hot-path changes with only their
# kernel tests run), in three lanes at once on the one GPU (compiles are CPU-bound; the engines size their KV cache from the
# memory free when they start, and each leaves most of it to the others' tiny models).
source benchmarks/device_env.sh
t0=$(date +%s); real_out=$OUT; mkdir -p /tmp/lanes
export OUT=/tmp/lanes LANE_TIMEOUT=420
(lane test_gpu_first_request test_prefix_cache test_kernels_norm_rotary test_kernels_fp8_quant test_memory_fit \
  > /tmp/lanes/A.txt) &
(lane test_kernels_moe test_kernels_router test_kernels_moe_gate_up test_kernels_gemv test_kernels_fp8_linear \
  > /tmp/lanes/B.txt) &
(lane test_gpu_engine test_gpu_fp8_engine test_kernels_moe_fp8 test_kv_cache_fp8 test_router_lora \
  test_kernels_attention_lora test_layer_profile test_tensor_parallel > /tmp/lanes/C.txt) &
wait
cat /tmp/lanes/[ABC].txt
tar -czf $real_out/lanes.tgz -C /tmp lanes
echo "done $(( $(date +%s)-t0 ))s"
