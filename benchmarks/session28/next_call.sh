#!/usr/bin/env bash
# Prepared in session 28 for the next session's device calls (#24: BENCHMARKS.md, session 28 "Prepared"): two
# branches, each also a patch in benchmarks/session28/patches/:
#   s28-early-loads  the LoRA kernels' reads before their PDL wait (B = 1-8; FP8 expert GEMV late wait)
#   s28-side-stream  the dense LoRA shrink beside cuBLAS / the FP8 GEMM on a stream of its own (batch 3 and up)
#   s28-both         the two together (patches/s28-both/: the second rebased on the first), to merge both at once
# Before the calls, here:
#   bash benchmarks/ab_packages.sh main=HEAD early=s28-early-loads side=s28-side-stream
#   for b in early:s28-early-loads side:s28-side-stream; do git archive ${b#*:} tests | tar -x -C benchmarks/ab/${b%%:*}; done
# (if a branch is missing: git branch NAME main && git checkout NAME && git am benchmarks/session28/patches/NAME.patch
#  && git checkout main). Then, carry [".whl", "benchmarks/ab"]:
#   bash benchmarks/session28/next_call.sh 1   # early vs main: bench decode B = 1, 2, 4, 8 (base, active, mixed),
#                                              # bf16 and FP8, two rounds (~4 min warm)
#   bash benchmarks/session28/next_call.sh 2   # side, --no-lora-side-stream / on: B = 4, 8, 64, 256, 512 (base,
#                                              # active, mixed), bf16 two rounds, FP8 one
#   bash benchmarks/session28/next_call.sh 3 early   # a branch's GPU tests (kernels it touches, its engines, the
#   bash benchmarks/session28/next_call.sh 3 side    # first request), three lanes at once
#   bash benchmarks/session28/next_call.sh 4   # the step timeline at B = 1 and 8 from main and early
# Merge a branch if active / base rises with base unchanged and its GPU tests pass (then `-m gpu` and `bench
# protocol --parts cold` on the merged tree); else keep its patch as the record and delete it.
source benchmarks/device_env.sh
t0=$(date +%s); root=$PWD
if [ "${1:-1}" = 1 ]; then
  AB_TIMEOUT=120
  for r in 1 2; do for q in bf16 fp8; do
    extra=""; [ $q = fp8 ] && extra="--quantization fp8"
    ab_decode main ${q}_$r --batches 1,2,4,8 --modes base,active,mixed $extra
    ab_decode early ${q}_$r --batches 1,2,4,8 --modes base,active,mixed $extra
  done; done
  tar -czf $OUT/ab_early.tgz -C /tmp $(cd /tmp && ls ab_*.log)
  exit 0
fi
if [ "$1" = 2 ]; then  # one package, the flag off / on (--no-lora-side-stream: the sequential path)
  AB_TIMEOUT=130
  for r in 1 2; do
    ab_decode side off$r --batches 4,8,64,256,512 --modes base,active,mixed --no-lora-side-stream
    ab_decode side on$r --batches 4,8,64,256,512 --modes base,active,mixed
  done
  ab_decode side fp8off --batches 4,8,64,256,512 --modes base,active --quantization fp8 --no-lora-side-stream
  ab_decode side fp8on --batches 4,8,64,256,512 --modes base,active --quantization fp8
  tar -czf $OUT/ab_side.tgz -C /tmp $(cd /tmp && ls ab_*.log)
  exit 0
fi
if [ "$1" = 4 ]; then
  for p in main early; do
    (cd benchmarks/ab/$p && PYTHONPATH=/tmp/site:. timeout 120 python3 $root/benchmarks/session20/step_timeline.py \
      --batches 1,8 --modes base,active --out /tmp/tl_$p > $OUT/timeline_$p.log 2>&1)
    echo "timeline $p rc=$? $(( $(date +%s)-t0 ))s"
  done
  exit 0
fi
cd benchmarks/ab/${2:?which branch: early or side}
export OUT_REAL=$OUT OUT=/tmp/lanes LANE_TIMEOUT=400; mkdir -p /tmp/lanes
(lane test_kernels_moe test_kernels_gemv test_kernels_fp8_linear > /tmp/lanes/A.txt) &
(lane test_gpu_engine test_kernels_attention_lora test_router_lora test_prefix_cache > /tmp/lanes/B.txt) &
(lane test_gpu_fp8_engine test_kernels_moe_fp8 test_gpu_first_request > /tmp/lanes/C.txt) &
wait
cat /tmp/lanes/[ABC].txt
tar -czf $OUT_REAL/lanes_$2.tgz -C /tmp lanes
echo "tests $(( $(date +%s)-t0 ))s"
