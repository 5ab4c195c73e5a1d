#!/usr/bin/env bash
# Call 2 of session 15 (carry .whl): the shrinks fused into the MoE GEMMs' main loops (MoEPlan.lora_fused_shrink)
# against call 1's best, with the best plan's kernel split without PDL; then the decode step at KV blocks of 16 and
# 64 tokens (the attention's gathers).
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 280 python3 benchmarks/session15/lora_inplace.py --out $OUT --candidates fused --batches 64,256,512,1024 \
  --no-split-pdl 2>&1 | tee $OUT/lora_fused.txt | grep -v -i warn
for bs in 64 16; do
  echo "== decode block size $bs at $(( $(date +%s)-t0 )) s"
  timeout 100 python3 -m moeserve.bench.decode --layers 48 --batches 256,512 --modes base --steps 32 --repeats 1 \
    --block-size $bs --out $OUT/decode_block$bs 2>&1 | grep -E "^ +[0-9]+ |Error|error" | sed "s/^/block $bs /"
done
echo "done at $(( $(date +%s)-t0 )) s"
