#!/usr/bin/env bash
# Call 5 of session 15 (carry .whl): the separate gate/up A kernels' GPU tests (their gate_up epilogue now walks the
# up halves in place), and `bench decode` base / active again at B = 64, 256, 512.
source benchmarks/device_env.sh
LANE_TIMEOUT=100 lane test_kernels_moe_gate_up
timeout 110 python3 -m moeserve.bench.decode --layers 48 --batches 64,256,512 --modes base,active --steps 32 \
  --repeats 1 --out $OUT/decode_again 2>&1 | grep -E "^ +[0-9]+ |Error|error|^ +B "
