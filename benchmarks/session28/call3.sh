#!/usr/bin/env bash
# Session 28 call 3: why session 27's producer shrink (branch s27-producer-shrink) made the active step slower at
# B = 1 (call 1: 3.25 -> 3.61 ms bf16): the whole graphed step kernel by kernel, main and the branch's package;
# then the real server on main (`bench protocol --parts cold`, bf16 and FP8).
source benchmarks/device_env.sh
t0=$(date +%s); root=$PWD
for p in main ps; do
  (cd benchmarks/ab/$p && PYTHONPATH=/tmp/site:. timeout 100 python3 $root/benchmarks/session20/step_timeline.py \
    --batches 1 --modes base,active --out /tmp/tl_$p > $OUT/timeline_$p.log 2>&1)
  echo "timeline $p rc=$? $(( $(date +%s)-t0 ))s"
done
timeout 230 python3 -m moeserve.bench.protocol --parts cold --out /tmp/cold_bf16 > $OUT/protocol_bf16.log 2>&1
echo "protocol bf16 rc=$? $(( $(date +%s)-t0 ))s"; grep -E "^run |^cold-" $OUT/protocol_bf16.log | tail -4
timeout $(( 585 - ($(date +%s)-t0) )) python3 -m moeserve.bench.protocol --parts cold --out /tmp/cold_fp8 \
  --server-args "--quantization fp8" > $OUT/protocol_fp8.log 2>&1
echo "protocol fp8 rc=$? $(( $(date +%s)-t0 ))s"; grep -E "^run |^cold-" $OUT/protocol_fp8.log | tail -4
echo "done $(( $(date +%s)-t0 ))s"
