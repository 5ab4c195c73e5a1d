#!/usr/bin/env bash
# Session 24, call 4: test_gpu_engine alone (call 3's lane, beside two others, passed its 7 tests but ran out of time
# before pytest's summary); then whether the alignment's saving (the step's timeline: ~4.8 us a layer at B = 256)
# shows in the synchronous step where the pipelined one showed none: bench decode --sync-steps, FP8, before
# (d920dd0) / after (this session's tree), A, B, A, B.
source benchmarks/device_env.sh
t0=$(date +%s)
LANE_TIMEOUT=170 lane test_gpu_engine
AB_TIMEOUT=60
for r in 1 2; do
  ab_decode before fp8s$r --batches 256 --modes base --quantization fp8 --sync-steps
  ab_decode after fp8s$r --batches 256 --modes base --quantization fp8 --sync-steps
done
ab_decode before fp8p --batches 256 --modes base --quantization fp8
ab_decode after fp8p --batches 256 --modes base --quantization fp8
tar -czf $OUT/ab_logs.tgz -C /tmp $(cd /tmp && ls ab_*.log)
echo "done $(( $(date +%s)-t0 ))s"
