#!/usr/bin/env bash
# Session 23, call 2, the final tree (442e8db reverted): GPU tests of what the revert touched and the fixed split-K
# LoRA test; then bench decode by LoRA mode, bf16 and FP8 alternated (A, B, A, B) at B = 1 ... 512, each printing
# the weights it holds; last, FP8 weights with the FP8 KV cache at B = 64-512 (beside #25, which excludes it).
source benchmarks/device_env.sh
t0=$(date +%s)
LANE_TIMEOUT=100 lane test_kernels_fp8_linear test_kernels_attention_lora
LANE_TIMEOUT=120 lane test_gpu_fp8_engine test_gpu_engine
dec() {  # $1 label, then the decode arguments
  local label=$1; shift
  timeout ${DEC_TIMEOUT:-100} python3 -m moeserve.bench.decode --layers 48 --steps 32 --repeats 1 --out /tmp/dec_$label \
    "$@" > /tmp/dec_$label.log 2>&1
  echo "$label rc=$? $(( $(date +%s)-t0 ))s: $(grep -E '^preset|^ +[0-9]+ ' /tmp/dec_$label.log | tr -s ' ' | tr '\n' '|')"; }
for round in 1 2; do
  [ $(( $(date +%s)-t0 )) -gt 430 ] && { echo "round $round skipped (time)"; break; }
  dec bf16_$round --batches 1,8,64,256,512 --modes base,idle-dual,active,mixed
  dec fp8_$round --batches 1,8,64,256,512 --modes base,idle-dual,active,mixed --quantization fp8
done
[ $(( $(date +%s)-t0 )) -lt 530 ] && DEC_TIMEOUT=50 dec fp8kv --batches 64,256,512 --modes base --quantization fp8 \
  --kv-cache-dtype fp8
tar -czf $OUT/dec_logs.tgz -C /tmp $(cd /tmp && ls dec_*.log) $(cd /tmp && ls -d dec_*/ | sed 's#/$##')
echo "done $(( $(date +%s)-t0 ))s"
