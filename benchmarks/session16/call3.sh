#!/usr/bin/env bash
# Call 3 (carry .whl): LoRA at prefill sizes. bf16: the in-place expands before the main loop (MoEPlan.lora_prologue)
# on the tuned 128-row tiles, against apart (the engine) and the in-place epilogue; FP8: in place on its 64-row W8A8
# tiles against apart at T = 1,024-4,096 (the table's 64-row rows reach 4,096).
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 200 python3 benchmarks/session16/lora_inplace.py --out $OUT --candidates prologue --batches 1024,2048,4096,8192 \
  --rounds 1 2>&1 | tee $OUT/lora_prologue.txt | grep -v -i warn
echo "== fp8 at $(( $(date +%s)-t0 )) s"
timeout 150 python3 benchmarks/session16/fp8_lora.py --out $OUT --batches 1024,2048,4096 2>&1 | tee $OUT/fp8_lora.txt \
  | grep -v -i warn
echo "done at $(( $(date +%s)-t0 )) s"
