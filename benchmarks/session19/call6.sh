#!/usr/bin/env bash
# Session 19, call 6 (tree of call 2): the first-request GPU tests (adapters first used after capture).
source benchmarks/device_env.sh; LANE_TIMEOUT=150 lane test_gpu_first_request
