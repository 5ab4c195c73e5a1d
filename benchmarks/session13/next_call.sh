#!/usr/bin/env bash
# Session 13's first device call (carry .whl): what session 12 built on the CPU or could not measure.
# 1. #24 item 2: the routed experts with adapters on the engine's plans (tuned table, TMA weight tiles) against
#    candidates (epilogue on the tuned small tiles at T <= 256; epilogue on 128x128 / 64x128 tiles above), with the
#    engine plan's per-kernel split: which LoRA kernel is the time at each T.
# 2. #25: FP8 MoE tile sweep (the FP8 sorted path runs bf16's tiles refitted, untuned; slower than bf16 from T=2,048).
# 3. #25: decode at 1-8 rows, bf16 against FP8 (the FP8 dense GEMV serves 1-2 rows since session 12; 2 unmeasured).
source benchmarks/device_env.sh
t0=$(date +%s)
echo "== MoE + LoRA plans"
timeout 220 python3 benchmarks/session13/lora_plans.py --out $OUT 2>&1 | grep -v Warn | tail -24
echo "== FP8 MoE sweep at $(( $(date +%s)-t0 )) s"
timeout 170 python3 -m benchmarks.kernels.fp8_moe --out $OUT --tokens 64,512,2048,8192 --parts moe --sweep 2>&1 \
  | grep -v Warn | tail -24
for q in bf16 fp8; do
  extra=""; [ $q = fp8 ] && extra="--quantization fp8"
  left=$(( 570 - $(date +%s) + t0 ))
  [ $left -gt 30 ] && timeout $left python3 -m moeserve.bench.decode --layers 48 --batches 1,2,4,8 --modes base,active \
    --steps 32 --repeats 1 $extra --out $OUT/decode_$q 2>&1 | grep -E "^ +[0-9]+ |B " | sed "s/^/$q /"
done
