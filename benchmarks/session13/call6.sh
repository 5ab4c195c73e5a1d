#!/usr/bin/env bash
# Session 13, call 6 (the device time left, ~100 s; carry .whl): FP8 decode at B = 1 with the GEMV's bf16 K step
# (set after call 4), then bf16 at B = 512 once more (call 4: 74 % of the floor, the target 75 %).
source benchmarks/device_env.sh
timeout 50 python3 -m moeserve.bench.decode --layers 48 --batches 1 --modes base --steps 32 --repeats 1 \
  --quantization fp8 --out $OUT/fp8 2>&1 | grep -E "^ +[0-9]+ " | sed "s/^/fp8 /"
timeout 45 python3 -m moeserve.bench.decode --layers 48 --batches 512 --modes base --steps 32 --repeats 1 \
  --out $OUT/bf16 2>&1 | grep -E "^ +[0-9]+ " | sed "s/^/bf16 /"
