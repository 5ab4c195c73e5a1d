#!/usr/bin/env bash
# Session 24, call 3: FP8 active A/B for the 2-lane shrink (before = the alignment commit), the FP8 step kernel by
# kernel at B = 256 on the final tree (where did the alignment's standalone 2x go?), then the GPU tests of what this
# session touched in three lanes on the one GPU (alignment, MoE kernels, the engines, no compile after warm-up).
source benchmarks/device_env.sh
t0=$(date +%s)
AB_TIMEOUT=80
ab_decode before fp8 --batches 256,512 --modes base,active --quantization fp8
ab_decode after fp8 --batches 256,512 --modes base,active --quantization fp8
ab_decode before fp8_2 --batches 256,512 --modes base,active --quantization fp8
ab_decode after fp8_2 --batches 256,512 --modes base,active --quantization fp8
timeout 100 python3 benchmarks/session20/step_timeline.py --quantization fp8 --batches 256 --modes base,active \
  --out /tmp/tl > $OUT/timeline_fp8_256.log 2>&1; echo "timeline rc=$? $(( $(date +%s)-t0 ))s"
grep -vE "^\s*$|[Ww]arn" $OUT/timeline_fp8_256.log | tail -40
LANE_TIMEOUT=230 lane test_gpu_first_request &
(LANE_TIMEOUT=200 lane test_kernels_moe; LANE_TIMEOUT=120 lane test_kernels_moe_fp8) &
(LANE_TIMEOUT=120 lane test_gpu_engine test_gpu_fp8_engine) &
wait
tar -czf $OUT/ab_logs.tgz -C /tmp $(cd /tmp && ls ab_*.log)
echo "done $(( $(date +%s)-t0 ))s"
