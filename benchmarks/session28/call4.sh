#!/usr/bin/env bash
# Session 28 call 4: session 26's fp8-KV decode attention in fp16 (branch s28-kv-fp16 = s26-kv-fp16 on this main):
# its GPU tests, then bench decode FP8 weights + fp8 KV cache at B = 64, 256, 512, main / branch, A, B, A, B; then
# the real server again on main (`bench protocol --parts cold`, FP8 then bf16: a second sample beside call 3's).
source benchmarks/device_env.sh
t0=$(date +%s); root=$PWD
(cd benchmarks/ab/kv16 && PYTHONPATH=/tmp/site timeout 120 python3 -m pytest -q -m gpu tests/test_kv_cache_fp8.py \
  -p no:cacheprovider -rf > $OUT/kv16_tests.log 2>&1)
echo "kv16 tests rc=$? $(( $(date +%s)-t0 ))s: $(tail -1 $OUT/kv16_tests.log)"
AB_TIMEOUT=90
for r in 1 2; do
  ab_decode main kv_$r --batches 64,256,512 --modes base,active --quantization fp8 --kv-cache-dtype fp8
  ab_decode kv16 kv_$r --batches 64,256,512 --modes base,active --quantization fp8 --kv-cache-dtype fp8
done
tar -czf $OUT/ab_kv.tgz -C /tmp $(cd /tmp && ls ab_*kv_*.log)
timeout 200 python3 -m moeserve.bench.protocol --parts cold --out /tmp/cold_fp8 \
  --server-args "--quantization fp8" > $OUT/protocol_fp8.log 2>&1
echo "protocol fp8 rc=$? $(( $(date +%s)-t0 ))s"; grep -E "^run |^cold-" $OUT/protocol_fp8.log | tail -4
timeout $(( 590 - ($(date +%s)-t0) )) python3 -m moeserve.bench.protocol --parts cold --out /tmp/cold_bf16 \
  > $OUT/protocol_bf16.log 2>&1
echo "protocol bf16 rc=$? $(( $(date +%s)-t0 ))s"; grep -E "^run |^cold-" $OUT/protocol_bf16.log | tail -4
echo "done $(( $(date +%s)-t0 ))s"
