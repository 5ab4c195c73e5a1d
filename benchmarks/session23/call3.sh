#!/usr/bin/env bash
# Session 23, call 3: the real server on the final tree, bf16 then FP8 (`bench protocol --parts cold`: 256 streaming
# clients, base traffic, then 4 adapters just loaded, then the same adapter traffic again).
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 240 python3 -m moeserve.bench.protocol --parts cold --out /tmp/cold_bf16 > $OUT/protocol_bf16.log 2>&1
echo "protocol bf16 rc=$? $(( $(date +%s)-t0 ))s"; grep -E "^run |^cold-" $OUT/protocol_bf16.log | tail -4
timeout $(( 500 - ($(date +%s)-t0) )) python3 -m moeserve.bench.protocol --parts cold --out /tmp/cold_fp8 \
  --server-args "--quantization fp8" > $OUT/protocol_fp8.log 2>&1
echo "protocol fp8 rc=$? $(( $(date +%s)-t0 ))s"; grep -E "^run |^cold-" $OUT/protocol_fp8.log | tail -4
