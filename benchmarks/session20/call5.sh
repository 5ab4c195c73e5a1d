#!/usr/bin/env bash
# Session 20, calls 5 and 6 (the final tree, c3600cf, on call 4's machine held warm): the engine GPU tests again after
# the norm shrink's revert (call 4 ran them with it; its first-request lane was cut at 140 s after 20 of 21).
source benchmarks/device_env.sh; LANE_TIMEOUT=180 lane test_gpu_first_request   # call 5
# call 6: LANE_TIMEOUT=100 lane test_gpu_engine
