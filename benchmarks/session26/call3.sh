#!/usr/bin/env bash
# Session 26 call 3: bf16's 256-token row with both expert GEMMs in plain block order (group_m 4 -> 1; call 2 found
# the plain order ~5 % faster with LoRA in the W8A8 512 row, base equal), bench decode B = 256 A, B, A, B; then
# the merged tree (bf16 GEMV and FP8 dense GEMV without exchange, FP8 512-token row in plain block order): its GPU
# tests on the hot path, then the real server FP8 and bf16 (`bench protocol --parts cold`).
source benchmarks/device_env.sh
t0=$(date +%s); root=$PWD
for r in 1 2; do
  for v in shipped bf16g1_256; do
    tiles=""; [ $v != shipped ] && tiles=$root/benchmarks/session26/moe_tiles_$v.json
    MOESERVE_MOE_TILES=$tiles timeout 80 python3 -m moeserve.bench.decode --layers 48 --steps 32 --repeats 1 \
      --batches 256 --modes base,active,mixed --out /tmp/dec_bf16_$v$r > /tmp/dec_bf16_$v$r.log 2>&1
    echo "bf16 $v$r rc=$? $(( $(date +%s)-t0 ))s: $(grep -E '^ +[0-9]+ ' /tmp/dec_bf16_$v$r.log | tr -s ' ' | tr '\n' '|')"
  done
done
tar -czf $OUT/logs.tgz -C /tmp $(cd /tmp && ls dec_*.log)
LANE_TIMEOUT=120 lane test_kernels_gemv test_kernels_fp8_linear test_kernels_moe_fp8 test_gpu_fp8_engine
timeout 220 python3 -m moeserve.bench.protocol --parts cold --out /tmp/cold_fp8 \
  --server-args "--quantization fp8" > $OUT/protocol_fp8.log 2>&1
echo "protocol fp8 rc=$? $(( $(date +%s)-t0 ))s"; grep -E "^run |^cold-" $OUT/protocol_fp8.log | tail -4
timeout $(( 575 - ($(date +%s)-t0) )) python3 -m moeserve.bench.protocol --parts cold --out /tmp/cold_bf16 \
  > $OUT/protocol_bf16.log 2>&1
echo "protocol bf16 rc=$? $(( $(date +%s)-t0 ))s"; grep -E "^run |^cold-" $OUT/protocol_bf16.log | tail -4
echo "done $(( $(date +%s)-t0 ))s"
