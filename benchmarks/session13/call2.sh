#!/usr/bin/env bash
# Session 13, call 2 (carry .whl): #25 the FP8 MoE tile sweep at the token counts call 1 did not cover (T = 1, 8: GEMV
# tiles; 16 ... 4,096: sorted tiles, weight-only and W8A8), the dense FP8 sweep (weight-only, W8A8, _scaled_mm), and
# #22 item 4: the per-layer budget of the bf16 decode step at B = 256 and 512.
source benchmarks/device_env.sh
t0=$(date +%s)
echo "== FP8 MoE sweep"
timeout 240 python3 -m benchmarks.kernels.fp8_moe --out $OUT/moe --tokens 1,8,16,128,256,1024,4096 --parts moe --sweep \
  2>&1 | grep -E "sweep|^ +[0-9]+ " | tail -40
echo "== FP8 dense sweep at $(( $(date +%s)-t0 )) s"
timeout 120 python3 -m benchmarks.kernels.fp8_moe --out $OUT/dense --tokens 1,8,64,256,2048,8192 --parts dense --sweep \
  2>&1 | grep -v Warn | tail -40
left=$(( 570 - $(date +%s) + t0 ))
echo "== decode profile at $(( $(date +%s)-t0 )) s"
[ $left -gt 40 ] && timeout $left python3 -m moeserve.bench.decode --layers 48 --batches 256,512 --modes base \
  --steps 32 --repeats 1 --profile --out $OUT/profile 2>&1 | grep -v Warn | tail -60
