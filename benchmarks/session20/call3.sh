#!/usr/bin/env bash
# (benchmarks/session20/act_epilogue.py ran from the act-epilogue merge, reverted after this call: it is at 7af72a6)
# Session 20, call 3 (tree after both helpers' merges): SiLU*up in the gate_up GEMM's epilogue against the shipped
# plans at prefill sizes, with its bitwise GPU test (#22); the GPU tests of this session's kernel changes (the input
# norm's q|k|v shrink at one row, the GEMV's entry wait, the M-major FP8 activation scales, the decode MoE's down
# shrink in the gate_up GEMV); decode at B = 1, 8, 64
# by LoRA mode (#24: did a launch fewer at one row pay?); FP8 decode without the scale copy (#25).
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 170 python3 benchmarks/session20/act_epilogue.py --out $OUT/act_epilogue > $OUT/act_epilogue.log 2>&1
echo "act_epilogue rc=$? $(( $(date +%s)-t0 ))s"; grep -vE "^\s*$|[Ww]arn" $OUT/act_epilogue.log | tail -22
timeout 120 python3 -m pytest -q tests/test_kernels_moe.py -k "act_epilogue or tma or qwen3 or down_shrink or mixed_ranks" \
  -rf --tb=short -p no:cacheprovider > $OUT/test_kernels_moe.log 2>&1
echo "test_kernels_moe rc=$?: $(tail -1 $OUT/test_kernels_moe.log)"
timeout 90 python3 -m pytest -q tests/test_kernels_moe_fp8.py -k "gpu or down_shrink" -rf --tb=short -p no:cacheprovider \
  > $OUT/test_kernels_moe_fp8.log 2>&1; echo "test_kernels_moe_fp8 rc=$?: $(tail -1 $OUT/test_kernels_moe_fp8.log)"
LANE_TIMEOUT=60 lane test_kernels_norm_rotary test_kernels_gemv test_kernels_fp8_linear test_kernels_fp8_quant
echo "== decode at $(( $(date +%s)-t0 ))s"
timeout 150 python3 -m moeserve.bench.decode --layers 48 --batches 1,8,64 --modes base,active,mixed --steps 32 \
  --repeats 1 --profile --profile-modes active --out /tmp/decode > $OUT/decode.log 2>&1; echo "rc=$?"
grep -E "proj|experts|norm|layer|B=" $OUT/decode.log | head -24; grep -A6 "^Decode tokens" $OUT/decode.log
echo "== FP8 decode at $(( $(date +%s)-t0 ))s"
timeout $(( 575 - ($(date +%s)-t0) )) python3 -m moeserve.bench.decode --layers 48 --batches 64,256,512 \
  --modes base,active --steps 32 --repeats 1 --quantization fp8 --out /tmp/decode_fp8 > $OUT/decode_fp8.log 2>&1
echo "rc=$?"; grep -A6 "^Decode tokens" $OUT/decode_fp8.log
echo "done at $(( $(date +%s)-t0 ))s"
