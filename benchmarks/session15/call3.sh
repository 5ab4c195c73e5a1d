#!/usr/bin/env bash
# Call 3 of session 15 (carry .whl): LoRA calls on the tuned tiles with the in-place epilogue (moe_plan.LORA_IN_PLACE)
# — the GPU tests of the MoE kernels, the first request (the warm-up must compile the new variants), the engine and
# the FP8 kernels (their apart LoRA options moved to fused_moe_fp8.apart_lora_options); the MoE with adapters on
# the engine's plan; `bench decode` base / active / mixed.
source benchmarks/device_env.sh
t0=$(date +%s)
LANE_TIMEOUT=150 lane test_kernels_moe test_gpu_first_request test_gpu_engine test_kernels_moe_fp8
timeout 100 python3 benchmarks/session15/lora_inplace.py --out $OUT --candidates engine --batches 16,64,256,512,1024 \
  --no-split-pdl 2>&1 | tee $OUT/lora_engine.txt | grep -v -i warn
echo "== decode at $(( $(date +%s)-t0 )) s"
timeout 150 python3 -m moeserve.bench.decode --layers 48 --batches 1,8,64,256,512 --modes base,active,mixed \
  --steps 32 --repeats 1 --out $OUT/decode 2>&1 | grep -E "^ +[0-9]+ |Error|error|^ +B "
echo "done at $(( $(date +%s)-t0 )) s"
