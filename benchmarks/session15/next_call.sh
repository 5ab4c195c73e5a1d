#!/usr/bin/env bash
# A first device call for the session after 15 (carry .whl; not yet run): the in-place MoE LoRA plan's shrinks
# (#24: at T = 256 they are 30 of its ~76 µs) split and laned other ways, with the split of the best without PDL; then
# `bench decode` active at B = 64, 256, 512 for the baseline of that machine.
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 200 python3 benchmarks/session15/lora_inplace.py --out $OUT --candidates shrinks --batches 64,256,512 \
  --no-split-pdl 2>&1 | tee $OUT/lora_shrinks.txt | grep -v -i warn
timeout 120 python3 -m moeserve.bench.decode --layers 48 --batches 64,256,512 --modes base,active --steps 32 \
  --repeats 1 --out $OUT/decode 2>&1 | grep -E "^ +[0-9]+ |Error|error|^ +B "
echo "done at $(( $(date +%s)-t0 )) s"
