#!/usr/bin/env bash
# Session 29 call 5: s28-both (early reads + side stream, side stream on everywhere) and main, bench decode
# B = 1 ... 512, one round; output in call5/output.txt (the call's stdout).
source benchmarks/device_env.sh; AB_TIMEOUT=150
ab_decode both fp8 --batches 1,2,4,8,64,256,512 --modes base,active,mixed --quantization fp8
ab_decode both bf16 --batches 1,2,4,8,64,256,512 --modes base,active,mixed
ab_decode main fp8 --batches 1,2,4,8,64,256,512 --modes base,active,mixed --quantization fp8
