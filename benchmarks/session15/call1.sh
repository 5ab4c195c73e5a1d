#!/usr/bin/env bash
# Call 1 of session 15 (carry .whl): the in-place LoRA epilogue (MoEPlan.lora_in_place) on the GPU — the sorted-LoRA GPU
# tests with it, then the routed experts with adapters on every plan candidate at T = 64 ... 8,192.
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 170 python3 -m pytest -q -m gpu tests/test_kernels_moe.py -k "sorted_lora or cuda_graph" -rf --tb=short \
  -p no:cacheprovider > $OUT/test_kernels_moe.log 2>&1
echo "test_kernels_moe rc=$? $(( $(date +%s)-t0 ))s: $(tail -1 $OUT/test_kernels_moe.log)"
timeout 330 python3 benchmarks/session15/lora_inplace.py --out $OUT 2>&1 | tee $OUT/lora_inplace.txt | grep -v Warn
echo "done at $(( $(date +%s)-t0 )) s"
