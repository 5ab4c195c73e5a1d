#!/usr/bin/env bash
# Session 24, call 1: the MoE alignment's options (pairs per placing program; one launch that counts in every
# program against the count kernel + placement) at decode sizes, its GPU test; then the step kernel by kernel at
# B = 64, 256, 512, bf16 and FP8, base and active, on the landed tree (fresh per-kernel numbers for this session).
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 150 python3 benchmarks/session24/align_sweep.py --out $OUT > $OUT/align_sweep.log 2>&1
echo "align rc=$? $(( $(date +%s)-t0 ))s"
LANE_TIMEOUT=90 lane test_kernels_moe
for q in bf16 fp8; do
  [ $(( $(date +%s)-t0 )) -gt 420 ] && { echo "timeline $q skipped (time)"; continue; }
  extra=""; [ $q = fp8 ] && extra="--quantization fp8"
  timeout 150 python3 benchmarks/session20/step_timeline.py $extra --batches 64,256,512 --modes base,active \
    --out /tmp/tl_$q > /tmp/timeline_$q.log 2>&1; echo "timeline $q rc=$? $(( $(date +%s)-t0 ))s"
done
tar -czf $OUT/call1.tgz -C /tmp $(cd /tmp && ls timeline_*.log) tl_bf16 tl_fp8 2>/dev/null
echo "done $(( $(date +%s)-t0 ))s"
