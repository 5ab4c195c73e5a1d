#!/usr/bin/env bash
# Session 29 call 4: the server protocol (cold, 256 clients) on main with FP8 weights and the fp8 KV cache (session
# 28's fp16 fp8-KV attention, through the server).
source benchmarks/device_env.sh; t0=$(date +%s)
timeout 330 python3 -m moeserve.bench.protocol --parts cold --out /tmp/cold_fp8kv \
  --server-args "--quantization fp8 --kv-cache-dtype fp8" > $OUT/protocol_fp8kv.log 2>&1
echo "protocol fp8kv rc=$? $(( $(date +%s)-t0 ))s"; grep -E "^run |^cold-" $OUT/protocol_fp8kv.log | tail -6
