#!/usr/bin/env bash
# Session 19, call 4 (tree of call 2): the FP8 engine's GPU tests on the grouped dense LoRA (its LoRA rows ride on
# the FP8 product), then FP8 decode by LoRA mode (#25: active / base >= 0.85).
source benchmarks/device_env.sh
t0=$(date +%s)
LANE_TIMEOUT=120 lane test_gpu_fp8_engine
echo "== fp8 decode at $(( $(date +%s)-t0 ))s"
timeout $(( 300 - ($(date +%s)-t0) )) python3 -m moeserve.bench.decode --layers 48 --batches 64,256,512 \
  --modes base,idle-dual,active --steps 32 --repeats 1 --quantization fp8 --out /tmp/decode_fp8 > $OUT/decode_fp8.log 2>&1
grep -A5 "^Decode tokens" $OUT/decode_fp8.log
echo "done at $(( $(date +%s)-t0 )) s"
