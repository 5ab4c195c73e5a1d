#!/usr/bin/env bash
# A second device call for the session after 21 (not yet run): the FP8 dense projections from 8 to 512 rows over
# the tile candidates (new narrow ones; 16 x 32 at 8-16 rows is what ships, unmeasured there), and the FP8 decode
# step kernel by kernel at B = 64 and 256 (where W8A8 runs: which launches sit on the critical path).
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 300 python3 -m benchmarks.kernels.fp8_moe --out $OUT/dense --parts dense --tokens 8,16,64,256,512 --sweep \
  > $OUT/dense_sweep.log 2>&1; echo "dense sweep rc=$? $(( $(date +%s)-t0 ))s"
grep -E "^dense|sweep fp8_w" $OUT/dense_sweep.log
timeout $(( 570 - ($(date +%s)-t0) )) python3 benchmarks/session20/step_timeline.py --quantization fp8 \
  --batches 64,256 --out $OUT/timeline > $OUT/timeline_fp8.log 2>&1; echo "timeline rc=$? $(( $(date +%s)-t0 ))s"
grep -vE "^\s*$|[Ww]arn" $OUT/timeline_fp8.log | tail -80
