#!/usr/bin/env bash
# Session 27 call 1: the weight prefetch before the PDL wait (branch s27-prefetch): bench decode at B = 1, 2, 4, 8
# (base and active), bf16 and FP8, main / prefetch; the branch's GPU tests; a second round while time allows.
# Before it: bash benchmarks/ab_packages.sh main=main pf=s27-prefetch
#            git archive s27-prefetch tests | tar -x -C benchmarks/ab/pf
# carry [".whl", "benchmarks/ab"].
source benchmarks/device_env.sh
t0=$(date +%s)
AB_TIMEOUT=100
round() { for q in bf16 fp8; do
  extra=""; [ $q = fp8 ] && extra="--quantization fp8"
  ab_decode main ${q}_$1 --batches 1,2,4,8 --modes base,active $extra
  ab_decode pf ${q}_$1 --batches 1,2,4,8 --modes base,active $extra
done; }
round 1
(cd benchmarks/ab/pf && LANE_TIMEOUT=100 lane test_kernels_gemv test_gpu_fp8_engine test_gpu_engine)
echo "tests done $(( $(date +%s)-t0 ))s"
[ $(( $(date +%s)-t0 )) -lt 330 ] && round 2
tar -czf $OUT/ab_pf.tgz -C /tmp $(cd /tmp && ls ab_*.log)
