#!/usr/bin/env bash
# Call 2 (carry .whl): the in-place LoRA epilogue in the FP8 GEMMs (#25) — its GPU tests, the FP8 MoE with 4
# adapters in place / apart / without LoRA, the bf16 no-LoRA MoE on 64-row tiles at prefill sizes (may the tuned
# table take them, so LoRA prefill can ride in place?), and `bench decode --quantization fp8` base / idle / active.
source benchmarks/device_env.sh
t0=$(date +%s)
LANE_TIMEOUT=150 lane test_kernels_moe_fp8 test_kernels_fp8_quant test_gpu_fp8_engine
echo "== kernels at $(( $(date +%s)-t0 )) s"
timeout 200 python3 benchmarks/session16/fp8_lora.py --out $OUT --prefill-base 2>&1 | tee $OUT/fp8_lora.txt \
  | grep -v -i warn
echo "== decode at $(( $(date +%s)-t0 )) s"
timeout 150 python3 -m moeserve.bench.decode --layers 48 --batches 1,8,64,256,512 --modes base,idle-dual,active \
  --quantization fp8 --steps 32 --repeats 1 --out $OUT/decode_fp8 2>&1 | grep -E "^ +[0-9]+ |Error|error|^ +B "
echo "done at $(( $(date +%s)-t0 )) s"
