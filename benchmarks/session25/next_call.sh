#!/usr/bin/env bash
# Prepared in session 25 for the next session's first device calls: A/B candidates on branches (each one purpose;
# merge what wins, delete the rest). Before the calls, here, all in one invocation (the script empties
# benchmarks/ab):
#   bash benchmarks/ab_packages.sh main=HEAD fp8gemv=s25-fp8-gemv route=s25-gemv-route bf16gemv=s25-bf16-gemv \
#     expert=s25-expert-gemv
# s25-fp8-gemv: the FP8 dense GEMV without shared-memory exchanges in its K loop (not yet run on a GPU: run
# test_kernels_fp8_linear -m gpu from it before merging); s25-gemv-route: that, and every 1-2 row weight-only FP8
# projection to the GEMV; s25-bf16-gemv: the bf16 GEMV with the same fix; s25-expert-gemv: the FP8 expert gate_up
# GEMV with it. Then, with carry [".whl", "benchmarks/ab"], two calls:
#   bash benchmarks/session25/next_call.sh 1   # the FP8 dense GEMV, main / s25-fp8-gemv, at 1-2 rows (fp8_moe
#                                               # --parts dense --sweep: its launches against the split tensor-core
#                                               # kernel); bench decode bf16 at B = 1, 2, 4, main / s25-bf16-gemv,
#                                               # A, B, A, B; then the W8A8 down GEMM's own tile at T = 256, 512, 1024
#                                               # (down_tiles.py; writes $OUT/moe_tiles_down.json)
#   cp <files_at>/moe_tiles_down.json benchmarks/session25/; bash benchmarks/session25/next_call.sh 2
#                                               # bench decode FP8 at B = 1, 2: main / s25-gemv-route /
#                                               # s25-expert-gemv, twice; then B = 64-512 shipped table / that table,
#                                               # A, B, A, B, and prefill
# If the GEMV beats the split kernel at one row (o 7.4 us, q|k|v 8.3-8.6 in session 25) and the routing branch wins
# the step, merge it (with gemv_serves' tests and docstring updated).
source benchmarks/device_env.sh
t0=$(date +%s)
root=$PWD
if [ "${1:-1}" = 1 ]; then
  for side in main fp8gemv; do
    dir=$root/benchmarks/ab/$side  # python -m: the cwd's moeserve comes first
    (cd $dir && PYTHONPATH=/tmp/site:$root timeout 100 python3 -m benchmarks.kernels.fp8_moe --out $OUT/dense_$side \
      --tokens 1,2 --parts dense --sweep > $OUT/dense_$side.log 2>&1)
    echo "dense $side rc=$? $(( $(date +%s)-t0 ))s"; grep -E "^dense|gemv:" $OUT/dense_$side.log
  done
  # the branch's GPU tests of the FP8 linear kernels (its package imported: python -m puts the cwd first)
  (cd $root/benchmarks/ab/fp8gemv && PYTHONPATH=/tmp/site:$root timeout 120 python3 -m pytest -q -m gpu \
    $root/tests/test_kernels_fp8_linear.py -p no:cacheprovider -rf > $OUT/fp8gemv_tests.log 2>&1)
  echo "fp8gemv tests rc=$? $(( $(date +%s)-t0 ))s: $(tail -1 $OUT/fp8gemv_tests.log)"
  for r in 1 2; do  # the bf16 GEMV (the 1-2 row projections it serves; B = 4 a control)
    ab_decode main bf16_$r --batches 1,2,4 --modes base,active
    ab_decode bf16gemv bf16_$r --batches 1,2,4 --modes base,active
  done
  tar -czf $OUT/ab_bf16.tgz -C /tmp $(cd /tmp && ls ab_*bf16*.log)
  timeout $(( 540 - ($(date +%s)-t0) )) python3 benchmarks/session25/down_tiles.py --out $OUT --tokens 256,512,1024 > $OUT/down_sweep.log 2>&1
  echo "sweep rc=$? $(( $(date +%s)-t0 ))s"; grep -E "^T |rows:" $OUT/down_sweep.log
  exit 0
fi
table=$PWD/benchmarks/session25/moe_tiles_down.json
[ -f "$table" ] || { echo "no $table: run part 1 and copy its table here first"; exit 2; }
for r in 1 2; do
  ab_decode main fp8_$r --batches 1,2 --modes base,active --quantization fp8
  ab_decode route fp8_$r --batches 1,2 --modes base,active --quantization fp8
  ab_decode expert fp8_$r --batches 1,2 --modes base,active --quantization fp8
done
for r in 1 2; do
  dec_tiles shipped$r "" --batches 64,256,512 --modes base,active
  dec_tiles down$r "$table" --batches 64,256,512 --modes base,active
done
pre_tiles shipped ""
pre_tiles down "$table"
tar -czf $OUT/logs.tgz -C /tmp $(cd /tmp && ls dec_*.log pre_*.log ab_*.log)
echo "done $(( $(date +%s)-t0 ))s"
