#!/usr/bin/env bash
# Session 29 call 8: main and v1 in bf16, B = 1, 2, 4, 8, two rounds (v1's bf16 1-4 rows looked slower in call 6);
# output in call8/output.txt.
source benchmarks/device_env.sh; AB_TIMEOUT=60
for r in 1 2; do
  ab_decode main bf16r$r --batches 1,2,4,8 --modes base,active,mixed
  ab_decode v1 bf16r$r --batches 1,2,4,8 --modes base,active,mixed
done
