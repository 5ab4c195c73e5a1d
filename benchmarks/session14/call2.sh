#!/usr/bin/env bash
# Call 2 of session 14 (carry .whl): the GPU tests this session changed (the FP8 activations test's greedy check,
# the MoE LoRA GPU tests with rows in adapter-slot order), prefill with every prompt on an adapter with the
# slot-sorted rows on and off in one engine (bf16 and FP8: FP8 ÷ bf16 prefill, #25's target 1.4), FP8 decode with
# idle and mixed LoRA (#25: idle-LoRA ÷ FP8 base >= 0.99).
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_fp8_engine.py -k activations -rf --tb=short \
  -p no:cacheprovider > $OUT/fp8_activations.log 2>&1; echo "fp8 activations rc=$?: $(tail -1 $OUT/fp8_activations.log)"
timeout 170 python3 -m pytest -q -m gpu tests/test_kernels_moe.py -k "sorted_lora_bf16_mixed or tma_match" -rf \
  --tb=short -p no:cacheprovider > $OUT/moe_lora.log 2>&1; echo "moe lora rc=$?: $(tail -1 $OUT/moe_lora.log)"
for q in bf16 fp8; do
  echo "== prefill $q at $(( $(date +%s)-t0 )) s"
  arg=""; [ $q = fp8 ] && arg="--quantization fp8"
  timeout 150 python3 benchmarks/session14/prefill_ab.py --layers 48 --rounds 3 --out $OUT $arg 2>&1 \
    | grep -E "tok/s|Error|error" | tail -5
done
echo "== FP8 decode, LoRA modes at $(( $(date +%s)-t0 )) s"
timeout 120 python3 -m moeserve.bench.decode --layers 48 --batches 1,64,256,512 --modes base,idle-dual,mixed \
  --steps 32 --repeats 1 --quantization fp8 --out $OUT/decode_fp8_modes 2>&1 | grep -E "^ +[0-9]+ |B "
rm -rf $OUT/prefill_model $OUT/prefill_adapters
