#!/usr/bin/env bash
# Prepared in session 27 for the next session's device calls (#24 at B = 1-8: the LoRA shrinks of q|k|v and o made
# by the launches that make their inputs; BENCHMARKS.md, session 27). Before the calls, here:
#   bash benchmarks/ab_packages.sh main=HEAD ps=s27-producer-shrink
#   git archive s27-producer-shrink tests | tar -x -C benchmarks/ab/ps
# (if the branch is missing: git branch s27-producer-shrink main && git checkout s27-producer-shrink &&
#  git am benchmarks/session27/patches/s27-producer-shrink.patch && git checkout main). Then, carry
# [".whl", "benchmarks/ab"]:
#   bash benchmarks/session27/next_call.sh 1   # bench decode B = 1, 2, 4, 8 (base, active, mixed), bf16 and FP8,
#                                              # main / branch, two rounds (~4 min warm, more with the start)
#   bash benchmarks/session27/next_call.sh 2   # the branch's GPU tests of the kernels it touches
#   bash benchmarks/session27/next_call.sh 3   # its engine GPU tests (bf16 and FP8: graphs vs eager, nolora bitwise)
# Merge the branch if active / base rises at B = 1-8 with base unchanged and its GPU tests pass; else delete it and
# keep the patch as the record. Session 26's next_call.sh part 4 (the fp8-KV fp16 attention, branch s26-kv-fp16)
# is still untimed.
source benchmarks/device_env.sh
t0=$(date +%s)
if [ "${1:-1}" = 1 ]; then
  AB_TIMEOUT=120
  for r in 1 2; do for q in bf16 fp8; do
    extra=""; [ $q = fp8 ] && extra="--quantization fp8"
    ab_decode main ${q}_$r --batches 1,2,4,8 --modes base,active,mixed $extra
    ab_decode ps ${q}_$r --batches 1,2,4,8 --modes base,active,mixed $extra
  done; done
  tar -czf $OUT/ab_ps.tgz -C /tmp $(cd /tmp && ls ab_*.log)
  exit 0
fi
cd benchmarks/ab/ps
if [ "$1" = 2 ]; then LANE_TIMEOUT=170 lane test_kernels_norm_rotary test_kernels_attention_lora test_kernels_gemv
else LANE_TIMEOUT=280 lane test_gpu_engine test_gpu_fp8_engine; fi
echo "tests $(( $(date +%s)-t0 ))s"
