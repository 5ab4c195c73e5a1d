#!/usr/bin/env bash
# Session 19, call 2 (tree fd183af: the dense LoRA on rows grouped by slot): its GPU tests, decode by LoRA mode
# (call 1 ran the tile-walking kernels: the same protocol), prefill with adapters (#22 item 3), then the dense LoRA
# kernels with their sweep (partial results saved per shape).
source benchmarks/device_env.sh
t0=$(date +%s)
LANE_TIMEOUT=100 lane test_kernels_attention_lora test_kernels_gemv test_gpu_engine
echo "== decode at $(( $(date +%s)-t0 ))s"
timeout 130 python3 -m moeserve.bench.decode --layers 48 --batches 1,8,64,256,512 --modes base,active,mixed --steps 32 \
  --repeats 1 --out /tmp/decode > $OUT/decode.log 2>&1; grep -A8 "^Decode tokens" $OUT/decode.log
echo "== prefill at $(( $(date +%s)-t0 ))s"
timeout 130 python3 -m moeserve.bench.prefill --layers 48 --lora --profile --profile-tokens 8192 --out /tmp/prefill \
  > $OUT/prefill.log 2>&1
echo "rc=$?"; grep -v "Warn\|warn" $OUT/prefill.log | tail -n 14
echo "== kernels at $(( $(date +%s)-t0 ))s"
timeout $(( 560 - ($(date +%s)-t0) )) python3 -m benchmarks.kernels.kernels --parts dense_lora --batches 256,512,8192,64,8 \
  --sweep --out /tmp/dl > $OUT/dense_lora.log 2>&1
echo "rc=$?"; grep -E "^ *(qkv|o) |sweep" $OUT/dense_lora.log | grep -vE "half|r8_of"
echo "done at $(( $(date +%s)-t0 )) s"
