#!/usr/bin/env bash
# Session 21, call 1 (session 20's next_call.sh as prepared):
# 1. where an active decode step's time goes kernel by kernel in its own graph at B = 1, 8, 256 and 512
#    (step_timeline.py: the region profile prices launches that the late wait hides; two launches removed in session
#    20 bought nothing; at 256 / 512 which expert kernels carry the LoRA's 13 / 27 µs a layer above its bytes);
# 2. the CPU-sized sorted-path MoE tests run on the GPU (not marked gpu): 14 failed in session 20's call 3, whose log
#    was cut before saying why (tf32 dots on fp32 inputs is the guess) — their messages, on the unchanged tree;
# 3. the FP8 expert GEMMs with the weights on the MMA's M side (fp8_swap_ab.py, a prototype checked on the CPU and
#    compiled for sm_90: 80 / 63 registers against the shipped tile's 168) against the shipped W8A8 path at T = 64-1,024
#    (#25: FP8 experts run at 69-74 % of their bytes floor at B = 256-512, bf16's at 86 %);
# 4. the real server in FP8 with adapters (#25's `bench serve`; last measured in session 19 on the tile walk).
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 170 python3 benchmarks/session20/step_timeline.py --batches 1,8,256,512 --out $OUT/timeline > $OUT/timeline.log 2>&1
echo "timeline rc=$? $(( $(date +%s)-t0 ))s"; grep -E "^B=|gap" $OUT/timeline.log | head -120
timeout 130 python3 benchmarks/session20/fp8_swap_ab.py --out $OUT/swap_ab > $OUT/swap_ab.log 2>&1
echo "swap_ab rc=$? $(( $(date +%s)-t0 ))s"; grep -vE "^\s*$|[Ww]arn" $OUT/swap_ab.log | tail -24
timeout 100 python3 -m pytest -q tests/test_kernels_moe.py -k "sorted and not gpu" -x -rf --tb=short \
  -p no:cacheprovider > $OUT/moe_cpu_tests_on_gpu.log 2>&1; echo "rc=$?"; grep -E "^E |assert|FAILED" \
  $OUT/moe_cpu_tests_on_gpu.log | head -12
timeout $(( 580 - ($(date +%s)-t0) )) python3 -m moeserve.bench.protocol --parts cold --out /tmp/cold_fp8 \
  --server-args "--quantization fp8" > $OUT/protocol_fp8.log 2>&1
echo "protocol fp8 rc=$? $(( $(date +%s)-t0 ))s"; grep -E "run |cold-|base " $OUT/protocol_fp8.log | tail -6
