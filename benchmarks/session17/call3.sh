#!/usr/bin/env bash
# Call 3: the in-place LoRA epilogue walking slots with the next slot's loads in flight (items 0) against one slot a
# dot (items 1, the engine's), in rank-16 and rank-64 pools, T = 64 ... 8,192; the FP8 GPU tests (the FP8 GEMMs run
# the same epilogue, now with vector B loads).
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 240 python3 benchmarks/session17/lora_walk.py --out $OUT 2>&1 | grep -E "^T=|Error|error"
echo "== tests at $(( $(date +%s)-t0 ))s"
LANE_TIMEOUT=150 lane test_kernels_moe_fp8 test_gpu_fp8_engine
echo "done at $(( $(date +%s)-t0 )) s"
