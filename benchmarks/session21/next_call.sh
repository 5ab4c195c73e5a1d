#!/usr/bin/env bash
# A first device call for the session after 21 (not yet run). Before it, here: `bash benchmarks/device_wheels.sh`
# and `bash benchmarks/session21/prepare_ab.sh` (four packages in ab_*/, untracked, travel with the tree); carry .whl.
# 1. The GPU tests of session 21's FP8 dense LoRA epilogue (a33518f: compiled for sm_90 offline, never run on a GPU).
# 2. A/B/C/D, each side run from inside its own package directory, printing which package it imported (from the
#    repository root `python -m` imports the root's package ahead of PYTHONPATH: BENCHMARKS.md, session 21):
#    main / norm (session 20's input-norm q|k|v shrink, reverted on a flawed A/B) / down (the decode MoE down shrink
#    in the gate_up GEMV, reverted on a cross-machine comparison), bf16 decode at B = 1 and 8, base and active;
#    main / fp8pre (main without the FP8 dense LoRA epilogue), FP8 decode at B = 1 and 2, base and active.
# 3. The FP8 dense tiles from 8 to 512 rows (new narrow candidates; the 16 x 32 tile at 8-16 rows is unmeasured).
source benchmarks/device_env.sh
t0=$(date +%s)
root=$PWD
LANE_TIMEOUT=60 lane test_kernels_fp8_linear
LANE_TIMEOUT=120 lane test_gpu_fp8_engine
ab() {  # $1 variant, $2 round, $3 extra decode args
  (cd $root/benchmarks/session21/ab_$1 && PYTHONPATH=/tmp/site timeout 30 python3 -c \
    "import moeserve; print('package', moeserve.__file__)" && PYTHONPATH=/tmp/site timeout 60 python3 -m \
    moeserve.bench.decode --layers 48 --modes base,active --steps 32 --repeats 1 --out /tmp/ab_$1$2 $3) \
    > $OUT/ab_$1_$2.log 2>&1
  echo "$1 round $2 rc=$? $(( $(date +%s)-t0 ))s: $(grep -E '^package|^ +[0-9]+ ' $OUT/ab_$1_$2.log | tr -s ' ' | tr '\n' '|')"; }
for round in 1 2; do
  for v in main norm down; do ab $v $round "--batches 1,8"; done
  for v in main fp8pre; do ab $v fp8_$round "--batches 1,2 --quantization fp8"; done
done
timeout $(( 575 - ($(date +%s)-t0) )) python3 -m benchmarks.kernels.fp8_moe --out $OUT/dense --parts dense \
  --tokens 8,16,64,256,512 --sweep > $OUT/dense_sweep.log 2>&1; echo "dense sweep rc=$? $(( $(date +%s)-t0 ))s"
grep -E "^dense|sweep fp8_w" $OUT/dense_sweep.log
