#!/usr/bin/env bash
# Session 19, call 3 (tree of call 2): test_gpu_engine whole (call 2 cut it at 100 s after 4 passed, the Triton
# cache cold), then the real server with adapters against base traffic on the grouped dense LoRA (#24: 0.85).
source benchmarks/device_env.sh
t0=$(date +%s)
LANE_TIMEOUT=220 lane test_gpu_engine
echo "== protocol at $(( $(date +%s)-t0 ))s"
timeout $(( 590 - ($(date +%s)-t0) )) python3 -m moeserve.bench.protocol --parts cold --out /tmp/cold > $OUT/protocol_bf16.log 2>&1
echo "protocol bf16 rc=$? $(( $(date +%s)-t0 ))s"; grep -E "run |cold-|base " $OUT/protocol_bf16.log | tail -6
