#!/usr/bin/env bash
# Session 24, call 2: the alignment change (66c466c) — its GPU tests, then bench decode A/B (before = its parent)
# bf16 and FP8, base and active at B = 64, 256, 512; then the FP8 expert LoRA's shrink options (fp8_lora_sweep.py).
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 120 python3 -m pytest -q -m gpu tests/test_kernels_moe.py -k "align" -p no:cacheprovider > $OUT/align_tests.log 2>&1
echo "align tests rc=$? $(( $(date +%s)-t0 ))s: $(tail -1 $OUT/align_tests.log)"
AB_TIMEOUT=100
ab_decode before bf16 --batches 64,256,512 --modes base,active
ab_decode after bf16 --batches 64,256,512 --modes base,active
ab_decode before fp8 --batches 64,256,512 --modes base,active --quantization fp8
ab_decode after fp8 --batches 64,256,512 --modes base,active --quantization fp8
timeout $(( 540 - ($(date +%s)-t0) )) python3 benchmarks/session24/fp8_lora_sweep.py --tokens 256,512,64 --out $OUT \
  > $OUT/fp8_lora_sweep.log 2>&1; echo "sweep rc=$? $(( $(date +%s)-t0 ))s"
grep -E "^T " $OUT/fp8_lora_sweep.log | cut -c1-200
tar -czf $OUT/ab_logs.tgz -C /tmp $(cd /tmp && ls ab_*.log)
echo "done $(( $(date +%s)-t0 ))s"
