#!/usr/bin/env bash
# Prepared in session 28 for the next session's device calls (#24 at B = 1-8: the LoRA kernels' reads before
# their PDL wait; BENCHMARKS.md, session 28 "Prepared"). Before the calls, here:
#   bash benchmarks/ab_packages.sh main=HEAD early=s28-early-loads
#   git archive s28-early-loads tests | tar -x -C benchmarks/ab/early
# (if the branch is missing: git branch s28-early-loads main && git checkout s28-early-loads &&
#  git am benchmarks/session28/patches/s28-early-loads.patch && git checkout main). Then, carry
# [".whl", "benchmarks/ab"]:
#   bash benchmarks/session28/next_call.sh 1   # bench decode B = 1, 2, 4, 8 (base, active, mixed), bf16 and FP8,
#                                              # main / branch, two rounds; then B = 64, 256, 512 active, one round
#   bash benchmarks/session28/next_call.sh 2   # the branch's GPU tests: the kernels it touches, then its engines
#                                              # (graphs vs eager, nolora bitwise), three lanes at once
#   bash benchmarks/session28/next_call.sh 3   # the step timeline at B = 1 from each package (where the us went)
# Merge the branch if active / base rises with base unchanged and its GPU tests pass; else keep the patch as the
# record and delete the branch.
source benchmarks/device_env.sh
t0=$(date +%s); root=$PWD
if [ "${1:-1}" = 1 ]; then
  AB_TIMEOUT=120
  for r in 1 2; do for q in bf16 fp8; do
    extra=""; [ $q = fp8 ] && extra="--quantization fp8"
    ab_decode main ${q}_$r --batches 1,2,4,8 --modes base,active,mixed $extra
    ab_decode early ${q}_$r --batches 1,2,4,8 --modes base,active,mixed $extra
  done; done
  ab_decode main big --batches 64,256,512 --modes base,active
  ab_decode early big --batches 64,256,512 --modes base,active
  tar -czf $OUT/ab_early.tgz -C /tmp $(cd /tmp && ls ab_*.log)
  exit 0
fi
if [ "$1" = 3 ]; then
  for p in main early; do
    (cd benchmarks/ab/$p && PYTHONPATH=/tmp/site:. timeout 100 python3 $root/benchmarks/session20/step_timeline.py \
      --batches 1 --modes base,active --out /tmp/tl_$p > $OUT/timeline_$p.log 2>&1)
    echo "timeline $p rc=$? $(( $(date +%s)-t0 ))s"
  done
  exit 0
fi
cd benchmarks/ab/early
export OUT_REAL=$OUT OUT=/tmp/lanes LANE_TIMEOUT=400; mkdir -p /tmp/lanes
(lane test_kernels_moe test_kernels_gemv test_kernels_fp8_linear > /tmp/lanes/A.txt) &
(lane test_gpu_engine test_kernels_attention_lora test_router_lora > /tmp/lanes/B.txt) &
(lane test_gpu_fp8_engine test_kernels_moe_fp8 test_gpu_first_request > /tmp/lanes/C.txt) &
wait
cat /tmp/lanes/[ABC].txt
tar -czf $OUT_REAL/lanes.tgz -C /tmp lanes
echo "tests $(( $(date +%s)-t0 ))s"
