#!/usr/bin/env bash
# Session 30 call 1: session 29's next_call.sh, run as `bash benchmarks/session29/next_call.sh 1` with the packages
# made by `benchmarks/ab_packages.sh main=HEAD grid1=508acdc grid2=s29-grid-shrink` (grid1 = the branch's first
# commit; the `s29-grid-shrink~5` written below is read by ab_packages.sh as "revert commit 5", no commit, which now
# stops it). Its text as it was:
# Prepared in session 29 for the next session's device calls (#24: BENCHMARKS.md, session 29 "Prepared"): branch
# s29-grid-shrink, also patches in benchmarks/session29/patches/ (0001: the dense bf16 GEMV makes its LoRA shrink in
# its own launch; 0002: the bf16 expert GEMVs theirs, the protocol in kernels/grid_roles.py; 0003 its GPU test; 0004:
# the FP8 expert GEMV, weight-only, too; 0005: tests after a review; 0006: one role function, launch test).
# Before the calls, here:
#   bash benchmarks/ab_packages.sh main=HEAD grid1=s29-grid-shrink~5 grid2=s29-grid-shrink
#   for b in grid1:s29-grid-shrink~5 grid2:s29-grid-shrink; do git archive ${b#*:} tests | tar -x -C benchmarks/ab/${b%%:*}; done
# (if the branch is missing: git branch s29-grid-shrink main && git checkout s29-grid-shrink && git am
#  benchmarks/session29/patches/*.patch && git checkout main). Then, carry [".whl", "benchmarks/ab"]:
#   bash benchmarks/session29/next_call.sh 1   # main / grid1 / grid2: bench decode bf16 B = 1, 2, 4, 8, 64 (base,
#                                              # active, mixed), two rounds; main / grid2 FP8 B = 1, 2, 4, 8 (~5 min)
#   bash benchmarks/session29/next_call.sh 2   # grid2's GPU tests that its kernels reach, three lanes (~5 min)
#   bash benchmarks/session29/next_call.sh 3   # the step timeline at B = 1 and 8, main and grid2
# Merge if active / base rises with base unchanged and the GPU tests pass (then `-m gpu` and `bench protocol
# --parts cold` on the merged tree); a hang in call 2 is the ticket protocol's to explain (kernels/grid_roles.py).
source benchmarks/device_env.sh
t0=$(date +%s); root=$PWD
if [ "${1:-1}" = 1 ]; then
  AB_TIMEOUT=120
  for r in 1 2; do
    for p in main grid1 grid2; do ab_decode $p bf16_$r --batches 1,2,4,8,64 --modes base,active,mixed; done
    for p in main grid2; do ab_decode $p fp8_$r --batches 1,2,4,8 --modes base,active,mixed --quantization fp8; done
  done
  tar -czf $OUT/ab_grid.tgz -C /tmp $(cd /tmp && ls ab_*.log)
  exit 0
fi
if [ "$1" = 3 ]; then
  for p in main grid2; do
    (cd benchmarks/ab/$p && PYTHONPATH=/tmp/site:. timeout 120 python3 $root/benchmarks/session20/step_timeline.py \
      --batches 1,8 --modes base,active --out /tmp/tl_$p > $OUT/timeline_$p.log 2>&1)
    echo "timeline $p rc=$? $(( $(date +%s)-t0 ))s"
  done
  exit 0
fi
cd benchmarks/ab/grid2
export OUT_REAL=$OUT OUT=/tmp/lanes LANE_TIMEOUT=420; mkdir -p /tmp/lanes
(lane test_kernels_gemv test_kernels_moe test_kernels_moe_gate_up > /tmp/lanes/A.txt) &
(lane test_gpu_engine test_kernels_attention_lora test_router_lora test_prefix_cache > /tmp/lanes/B.txt) &
(lane test_gpu_first_request test_gpu_fp8_engine test_kernels_moe_fp8 > /tmp/lanes/C.txt) &
wait
cat /tmp/lanes/[ABC].txt
tar -czf $OUT_REAL/lanes_grid2.tgz -C /tmp lanes
echo "tests $(( $(date +%s)-t0 ))s"
