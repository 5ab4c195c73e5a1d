#!/usr/bin/env bash
# A first device call for the session after 16 (carry .whl; not yet run): the in-place MoE LoRA with the epilogue's
# slots and ranks loaded before the main loop (MoEPlan.lora_slots_early; its CPU test passes) and 256-column shrink
# steps, against the engine's plan at decode and prefill sizes; the MoE kernels' GPU tests on the new variant.
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 200 python3 benchmarks/session16/lora_inplace.py --out $OUT --candidates slots_early \
  --batches 16,64,256,512,2048,8192 --no-split-pdl 2>&1 | tee $OUT/lora_slots_early.txt | grep -v -i warn
echo "== tests at $(( $(date +%s)-t0 )) s"
timeout 150 python3 -m pytest -q -m gpu tests/test_kernels_moe.py -k "slots_early" -rf --tb=short \
  -p no:cacheprovider > $OUT/test_kernels_moe.log 2>&1; echo "rc=$? $(tail -1 $OUT/test_kernels_moe.log)"
echo "done at $(( $(date +%s)-t0 )) s"
