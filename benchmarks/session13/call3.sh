#!/usr/bin/env bash
# Session 13, call 3 (carry .whl): #25 the FP8 engine's new defaults (the tuned FP8 tile rows, W8A8 on the sorted
# path and the dense GEMMs from 64 rows through scaled_mm, weight-only GEMVs): the FP8 GPU tests, the kernel bench
# with fp8_auto, a sweep at T = 2 and 4 (the GEMV / sorted threshold), decode bf16 against FP8.
source benchmarks/device_env.sh
t0=$(date +%s)
LANE_TIMEOUT=200 lane test_kernels_fp8_linear test_kernels_moe_fp8 test_gpu_fp8_engine
echo "== FP8 MoE at $(( $(date +%s)-t0 )) s"
timeout 150 python3 -m benchmarks.kernels.fp8_moe --out $OUT/moe --tokens 1,2,4,8,64,256,512,2048,8192 --parts moe \
  2>&1 | grep -E "^ +[0-9]+ |T  " | tail -10
timeout 60 python3 -m benchmarks.kernels.fp8_moe --out $OUT/moe24 --tokens 2,4 --parts moe --sweep 2>&1 | grep -E "sweep" | tail -4
for q in bf16 fp8; do
  extra=""; [ $q = fp8 ] && extra="--quantization fp8"
  left=$(( 570 - $(date +%s) + t0 ))
  echo "== decode $q at $(( $(date +%s)-t0 )) s"
  [ $left -gt 30 ] && timeout $left python3 -m moeserve.bench.decode --layers 48 --batches 1,8,64,256,512 \
    --modes base,active --steps 32 --repeats 1 $extra --out $OUT/decode_$q 2>&1 | grep -E "^ +[0-9]+ |B " | sed "s/^/$q /"
done
