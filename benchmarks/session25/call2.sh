#!/usr/bin/env bash
# Session 25, call 2 (carry [".whl"]): the FP8 kernel and engine GPU tests on the tree with both session-24 options
# taken out; where the FP8 step's time goes at B = 1 and 8 now (#25 asks 1.3x bf16 at B = 1: 1.06 in session 23);
# the FP8 expert and dense tiles at 1-2 rows (fp8_moe --sweep); and whether a dense expand could ride the base
# cuBLAS GEMM as extra K columns (concat_k.py, #24).
source benchmarks/device_env.sh
t0=$(date +%s)
LANE_TIMEOUT=200 lane test_kernels_moe_fp8 test_gpu_fp8_engine
timeout 120 python3 benchmarks/session20/step_timeline.py --quantization fp8 --batches 1,8 --modes base,active \
  --out $OUT/timeline > $OUT/timeline_fp8.log 2>&1
echo "timeline rc=$? $(( $(date +%s)-t0 ))s"; grep -E "^B=" $OUT/timeline_fp8.log
timeout 90 python3 benchmarks/session25/concat_k.py --out $OUT/concat > $OUT/concat_k.log 2>&1
echo "concat rc=$? $(( $(date +%s)-t0 ))s"; grep -E "^(qkv|o) " $OUT/concat_k.log
timeout $(( 540 - ($(date +%s)-t0) )) python3 -m benchmarks.kernels.fp8_moe --out $OUT/gemv --tokens 1,2 \
  --parts moe,dense --sweep --sweep-mult fp8_w > $OUT/gemv_sweep.log 2>&1
echo "sweep rc=$? $(( $(date +%s)-t0 ))s"
tar -czf $OUT/jsons.tgz -C $OUT timeline concat gemv 2>/dev/null; rm -rf $OUT/timeline $OUT/concat $OUT/gemv
echo "done $(( $(date +%s)-t0 ))s"
