#!/usr/bin/env bash
# Call 6 (carry .whl; the command as given to the device): the epilogue's slots and ranks loaded before the main
# loop (MoEPlan.lora_slots_early, commit before its removal) and 256-column shrink steps, against the engine's plan.
source benchmarks/device_env.sh; timeout 110 python3 benchmarks/session16/lora_inplace.py --out $OUT --candidates slots_early --batches 64,256,512 --no-split-pdl 2>&1 | tee $OUT/lora_slots_early.txt | grep -v -i warn
