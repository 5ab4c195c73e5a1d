#!/usr/bin/env bash
# Session 22, call 3: the W8A8 expert tiles tuned per part (gate_up and down apart; the shipped FP8 rows tie them)
# at decode and prefill sizes, and the FP8 decode step kernel by kernel at B = 512 (the 1.30x batch).
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 420 python3 -m benchmarks.kernels.fp8_moe --out $OUT --tune --tokens 64,128,256,512,1024,2048,4096,8192 \
  > $OUT/tune.log 2>&1; echo "tune rc=$? $(( $(date +%s)-t0 ))s"
grep -E "^tune|Error|error" $OUT/tune.log | cut -c1-400
timeout $(( 560 - ($(date +%s)-t0) )) python3 benchmarks/session20/step_timeline.py --quantization fp8 \
  --batches 512 --out /tmp/timeline > $OUT/timeline_fp8_512.log 2>&1; echo "timeline rc=$? $(( $(date +%s)-t0 ))s"
grep -vE "^\s*$|[Ww]arn" $OUT/timeline_fp8_512.log | tail -45
