#!/usr/bin/env bash
# Session 20, call 2 (tree 5437d23: the prefill attention's launch by the longest query; no grouping launch without
# dense LoRA targets): the attention GPU tests on the new tiles, prefill with and without adapters (#22 item 3), where
# active LoRA's time goes at B = 1 and 8 (#24: 0.851 / 0.889), and the FP8 decode budget at B = 256 / 512 (#25).
source benchmarks/device_env.sh
t0=$(date +%s)
LANE_TIMEOUT=80 lane test_kernels_attention_lora
echo "== prefill at $(( $(date +%s)-t0 ))s"
timeout 140 python3 -m moeserve.bench.prefill --layers 48 --lora --profile --profile-tokens 8192 --out /tmp/prefill \
  > $OUT/prefill.log 2>&1
echo "rc=$?"; grep -v "Warn\|warn" $OUT/prefill.log | tail -n 6
echo "== decode profile B = 1, 8 at $(( $(date +%s)-t0 ))s"
timeout 120 python3 -m moeserve.bench.decode --layers 48 --batches 1,8 --modes base,active --steps 8 --profile \
  --profile-modes base,active --out /tmp/dp_small > $OUT/decode_profile_small.log 2>&1
echo "rc=$?"; grep -E "proj|experts|attention|norm|router|layer|Decode|^ *[0-9]" $OUT/decode_profile_small.log | head -40
echo "== FP8 decode profile at $(( $(date +%s)-t0 ))s"
timeout $(( 570 - ($(date +%s)-t0) )) python3 -m moeserve.bench.decode --layers 48 --batches 256,512 --modes base,active \
  --steps 8 --profile --profile-modes base,active --quantization fp8 --out /tmp/dp_fp8 > $OUT/decode_profile_fp8.log 2>&1
echo "rc=$?"; grep -E "proj|experts|attention|norm|router|layer|Decode|^ *[0-9]" $OUT/decode_profile_fp8.log | head -40
echo "done at $(( $(date +%s)-t0 ))s"
