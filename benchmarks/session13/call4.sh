#!/usr/bin/env bash
# Session 13, call 4 (carry .whl): the FP8 GPU tests after the scaled_mm fix; bench decode's pipelined step (the
# engine's launch n+1 / read n) for bf16 and FP8, with the synchronous loop beside it at B = 256 / 512 (#22 item 4).
source benchmarks/device_env.sh
t0=$(date +%s)
LANE_TIMEOUT=150 lane test_gpu_fp8_engine test_kernels_fp8_linear
for q in bf16 fp8; do
  extra=""; [ $q = fp8 ] && extra="--quantization fp8"
  echo "== decode $q at $(( $(date +%s)-t0 )) s"
  timeout 120 python3 -m moeserve.bench.decode --layers 48 --batches 1,8,64,256,512 --modes base,active,mixed \
    --steps 32 --repeats 1 $extra --out $OUT/decode_$q 2>&1 | grep -E "^ +[0-9]+ |B " | sed "s/^/$q /"
done
echo "== sync bf16 at $(( $(date +%s)-t0 )) s"
timeout 80 python3 -m moeserve.bench.decode --layers 48 --batches 256,512 --modes base --steps 32 --repeats 1 \
  --sync-steps --out $OUT/decode_sync 2>&1 | grep -E "^ +[0-9]+ |B " | sed "s/^/sync /"
