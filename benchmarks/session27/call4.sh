#!/usr/bin/env bash
# Session 27 call 4 (two runs, the last device seconds; logs in call4/): s26-expand-vec's GPU tests from its package
# (tests from the branch), each file under its lane's limit: test_kernels_moe_fp8 (190 s), then test_kernels_moe (115 s).
source benchmarks/device_env.sh
cd benchmarks/ab/vec && LANE_TIMEOUT=190 lane test_kernels_moe_fp8
LANE_TIMEOUT=115 lane test_kernels_moe
