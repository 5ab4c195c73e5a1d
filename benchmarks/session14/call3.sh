#!/usr/bin/env bash
# Call 3 of session 14 (carry .whl): the FP8 KV cache on the GPU — its GPU tests, the attention and KV-write kernels'
# GPU tests it touched, the bf16 engine's GPU tests (attention kernels' signatures changed), then `bench decode`
# with --kv-cache-dtype fp8 against auto, bf16 and FP8 weights, in one call.
source benchmarks/device_env.sh
t0=$(date +%s)
LANE_TIMEOUT=150 lane test_kv_cache_fp8 test_kernels_norm_rotary test_kernels_attention_lora test_gpu_engine
for w in bf16 fp8; do
  q=""; [ $w = fp8 ] && q="--quantization fp8"
  for kv in auto fp8; do
    echo "== decode $w weights, KV $kv at $(( $(date +%s)-t0 )) s"
    timeout 90 python3 -m moeserve.bench.decode --layers 48 --batches 1,64,256,512 --modes base,active --steps 32 \
      --repeats 1 $q --kv-cache-dtype $kv --out $OUT/decode_${w}_kv_$kv 2>&1 | grep -E "^ +[0-9]+ " | sed "s/^/$w kv=$kv /"
  done
done
echo "done at $(( $(date +%s)-t0 )) s"
