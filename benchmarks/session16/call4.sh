#!/usr/bin/env bash
# Call 4 (carry .whl): prefill with every prompt on an adapter, the MoE LoRA in place at every size against apart
# above 4,096 pairs, in the engine (bf16, then FP8); then the GPU tests of the MoE kernels (the in-place plans at
# every T once the threshold moves).
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 200 python3 benchmarks/session16/prefill_ab.py --layers 48 --out $OUT --rounds 2 2>&1 | grep -E "tok/s|Error|error"
echo "== fp8 at $(( $(date +%s)-t0 )) s"
timeout 200 python3 benchmarks/session16/prefill_ab.py --layers 48 --out $OUT --rounds 2 --quantization fp8 2>&1 \
  | grep -E "tok/s|Error|error"
echo "done at $(( $(date +%s)-t0 )) s"
rm -rf $OUT/prefill_model $OUT/prefill_adapters
