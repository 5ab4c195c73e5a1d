#!/usr/bin/env bash
# Second call for the session after 19: the real server in FP8 with adapters on the grouped dense LoRA (#25's `bench
# serve`; session 19 call 1 measured it on the tile walk: 0.819 of FP8 base, 1.20x bf16's base).
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 300 python3 -m moeserve.bench.protocol --parts cold --out /tmp/cold_fp8 --server-args "--quantization fp8" \
  > $OUT/protocol_fp8.log 2>&1
echo "protocol fp8 rc=$? $(( $(date +%s)-t0 ))s"; grep -E "run |cold-|base " $OUT/protocol_fp8.log | tail -6
