#!/usr/bin/env bash
# Session 19, call 5 (tree of call 2): FP8 prefill with every prompt on an adapter, its forward by region (the dense
# LoRA kernels now filed under "lora"), on the grouped dense LoRA.
source benchmarks/device_env.sh
timeout 200 python3 -m moeserve.bench.prefill --layers 48 --lora --profile --profile-tokens 8192 --quantization fp8 \
  --out /tmp/prefill_fp8 > $OUT/prefill_fp8.log 2>&1
echo "rc=$?"; grep -v "Warn\|warn" $OUT/prefill_fp8.log | tail -n 8
