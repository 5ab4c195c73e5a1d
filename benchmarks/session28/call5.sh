#!/usr/bin/env bash
# Session 28 call 5: the GPU tests that run the fp8 KV cache, on main with the fp16 decode attention merged.
source benchmarks/device_env.sh
LANE_TIMEOUT=120 lane test_kv_cache_fp8 test_gpu_fp8_engine
