#!/usr/bin/env bash
# Call 6 of session 15 (carry .whl): GPU tests of the LoRA engine paths the in-place plans reach (router LoRA, prefix
# cache by adapter) and the FP8 engine (its apart LoRA options).
source benchmarks/device_env.sh
LANE_TIMEOUT=80 lane test_router_lora test_prefix_cache test_gpu_fp8_engine
