#!/usr/bin/env bash
# Session 20, call 4 (the final tree: the down shrink and act-epilogue merges reverted, the input norm's q|k|v shrink
# at one row kept pending this call). First decode by LoRA mode at B = 1 ... 512 on this tree; then B = 1 without the
# norm's shrink (the package at 0374d20, extracted into ab_without_norm_shrink/, untracked) and with it, alternated,
# to say whether that launch fewer pays; then the GPU tests of the engine on this tree.
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 150 python3 -m moeserve.bench.decode --layers 48 --batches 1,8,64,256,512 --modes base,active,mixed --steps 32 \
  --repeats 1 --out /tmp/decode > $OUT/decode.log 2>&1; echo "decode rc=$?"; grep -A7 "^Decode tokens" $OUT/decode.log
echo "== A/B at B = 1 from $(( $(date +%s)-t0 ))s"
for round in 1 2; do
  for v in without with; do
    path=$([ $v = without ] && echo /tmp/site:benchmarks/session20/ab_without_norm_shrink || echo /tmp/site:.)
    PYTHONPATH=$path timeout 60 python3 -m moeserve.bench.decode --layers 48 --batches 1 --modes base,active \
      --steps 32 --repeats 1 --out /tmp/ab_$v$round > $OUT/ab_${v}_$round.log 2>&1
    echo "$v round $round rc=$?: $(grep -E '^ +1 ' $OUT/ab_${v}_$round.log)"
  done
done
echo "== GPU tests from $(( $(date +%s)-t0 ))s"
LANE_TIMEOUT=140 lane test_gpu_engine test_gpu_first_request
LANE_TIMEOUT=$(( 570 - ($(date +%s)-t0) )) lane test_gpu_fp8_engine
echo "done at $(( $(date +%s)-t0 ))s"
