#!/usr/bin/env bash
# Call 5 of session 14 (carry .whl): the fp8 KV cache's decode tile (128 tokens, 4 stages) on the GPU: its GPU tests,
# then decode with it against the bf16 cache, bf16 and FP8 weights.
source benchmarks/device_env.sh
t0=$(date +%s)
LANE_TIMEOUT=100 lane test_kv_cache_fp8
for w in bf16 fp8; do
  q=""; [ $w = fp8 ] && q="--quantization fp8"
  for kv in auto fp8; do
    timeout 60 python3 -m moeserve.bench.decode --layers 48 --batches 64,256,512 --modes base --steps 32 \
      --repeats 1 $q --kv-cache-dtype $kv --out $OUT/decode_${w}_kv_$kv 2>&1 | grep -E "^ +[0-9]+ " | sed "s/^/$w kv=$kv /"
  done
done
echo "done at $(( $(date +%s)-t0 )) s"
