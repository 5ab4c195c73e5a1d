#!/usr/bin/env bash
# Session 27 call 3 (the command as run; output in call3/ab_vec.txt): session 26's next_call.sh part 3, trimmed to the
# device time left: bench decode active, main / s26-expand-vec, bf16 and FP8, two rounds. Packages:
#   bash benchmarks/ab_packages.sh main=main vec=s26-expand-vec ; carry [".whl", "benchmarks/ab"]
source benchmarks/device_env.sh; t0=$(date +%s)
for r in 1 2; do for q in bf16 fp8; do
  [ $(( $(date +%s)-t0 )) -gt 230 ] && break 2
  extra=""; [ $q = fp8 ] && extra="--quantization fp8"
  ab_decode main ${q}_$r --batches 64,256,512 --modes base,active $extra
  ab_decode vec ${q}_$r --batches 64,256,512 --modes base,active $extra
done; done
