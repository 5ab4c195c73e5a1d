#!/usr/bin/env bash
# Call 1 (carry .whl): the in-place MoE LoRA plan's shrinks split and laned other ways (#24; at T = 256 they are 30 of
# its ~76 us), the in-place epilogue on 64- and 32-row tiles at prefill sizes against apart, and `bench decode`
# base / active at B = 64, 256, 512 for this machine's baseline.
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 170 python3 benchmarks/session16/lora_inplace.py --out $OUT --candidates shrinks --batches 64,256,512 \
  --no-split-pdl 2>&1 | tee $OUT/lora_shrinks.txt | grep -v -i warn
echo "shrinks done at $(( $(date +%s)-t0 )) s"
timeout 170 python3 benchmarks/session16/lora_inplace.py --out $OUT --candidates prefill --batches 1024,2048,8192 \
  --rounds 1 2>&1 | tee $OUT/lora_prefill.txt | grep -v -i warn
echo "prefill done at $(( $(date +%s)-t0 )) s"
timeout 130 python3 -m moeserve.bench.decode --layers 48 --batches 64,256,512 --modes base,active --steps 32 \
  --repeats 1 --out $OUT/decode 2>&1 | grep -E "^ +[0-9]+ |Error|error|^ +B "
echo "done at $(( $(date +%s)-t0 )) s"
