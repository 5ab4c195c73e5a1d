#!/usr/bin/env bash
# Prepared in session 26 for the next session's first device calls (#25 prefill: BENCHMARKS.md, session 26,
# "Prepared without device time"). Before the calls, here:
#   bash benchmarks/ab_packages.sh main=HEAD sorted=s26-act-sorted vec=s26-expand-vec kv16=s26-kv-fp16
#   for b in sorted:s26-act-sorted kv16:s26-kv-fp16; do   # their tests too (the scripts come from main's tree)
#     git archive ${b#*:} tests | tar -x -C benchmarks/ab/${b%%:*}; done
# (if the branch is missing: git branch s26-act-sorted main && git checkout s26-act-sorted &&
#  git am benchmarks/session26/patches/s26-act-sorted.patch && git checkout main; s26-expand-vec and s26-kv-fp16 the
#  same way from their patches). Then, carry [".whl", "benchmarks/ab"]:
#   bash benchmarks/session26/next_call.sh 1   # the minimal warp-specialization probe; the branch's GPU tests
#                                              # (act_sorted / warp-specialized plans bitwise the shipped one);
#                                              # the expert GEMMs at T = 8,192, 2,048, 512, 256 with those plans (ws_tiles.py:
#                                              # writes $OUT/ws/moe_tiles_ws.json with the rows that won by 3 %)
#   cp <files_at>/ws/moe_tiles_ws.json benchmarks/session26/; bash benchmarks/session26/next_call.sh 2
#                                              # bench prefill FP8 (base and --lora) from the branch, shipped table /
#                                              # that table, A, B, A, B
#   bash benchmarks/session26/next_call.sh 3   # the expand epilogue's vector loads (s26-expand-vec): bench decode
#                                              # active, bf16 and FP8, B = 64, 256, 512, main / branch, A, B, A, B
#   bash benchmarks/session26/next_call.sh 4   # the fp8 KV cache's decode attention in fp16 (s26-kv-fp16): its GPU
#                                              # tests, session 14's tile sweep from each package, and bench decode
#                                              # --quantization fp8 --kv-cache-dtype fp8 at B = 64, 256, 512, A, B, A, B
# Merge the branch if the prefill wins and its GPU tests pass (with the table rows); else delete it and report #25's
# prefill target as missed with this as the reason.
source benchmarks/device_env.sh
t0=$(date +%s); root=$PWD; dir=$root/benchmarks/ab/sorted
if [ "${1:-1}" = 1 ]; then
  timeout 150 python3 benchmarks/session26/ws_probe.py > $OUT/ws_probe.log 2>&1
  echo "ws_probe rc=$? $(( $(date +%s)-t0 ))s"; tail -12 $OUT/ws_probe.log
  (cd $dir && PYTHONPATH=/tmp/site timeout 150 python3 -m pytest -q -m gpu tests/test_kernels_moe_fp8.py \
    -p no:cacheprovider -rf > $OUT/sorted_tests.log 2>&1)
  echo "branch tests rc=$? $(( $(date +%s)-t0 ))s: $(tail -1 $OUT/sorted_tests.log)"
  (cd $dir && PYTHONPATH=/tmp/site:$dir:$root timeout $(( 560 - ($(date +%s)-t0) )) python3 \
    $root/benchmarks/session26/ws_tiles.py --out $OUT/ws --tokens 8192,2048,512,256 > $OUT/ws_tiles.log 2>&1)
  echo "ws_tiles rc=$? $(( $(date +%s)-t0 ))s"; grep -E "^T |^  T|rows:" $OUT/ws_tiles.log
  exit 0
fi
if [ "$1" = 4 ]; then
  kv=$root/benchmarks/ab/kv16
  (cd $kv && PYTHONPATH=/tmp/site timeout 150 python3 -m pytest -q -m gpu tests/test_kv_cache_fp8.py \
    -p no:cacheprovider -rf > $OUT/kv16_tests.log 2>&1)
  echo "kv16 tests rc=$? $(( $(date +%s)-t0 ))s: $(tail -1 $OUT/kv16_tests.log)"
  for side in main kv16; do
    (cd $root/benchmarks/ab/$side && PYTHONPATH=/tmp/site:$root/benchmarks/ab/$side:$root timeout 170 python3 \
      $root/benchmarks/session14/kv_fp8_sweep.py --out $OUT/sweep_$side --batches 256,512 > $OUT/sweep_$side.log 2>&1)
    echo "sweep $side rc=$? $(( $(date +%s)-t0 ))s"; grep -E "^B=" $OUT/sweep_$side.log
  done
  for r in 1 2; do
    ab_decode main kv_$r --batches 64,256,512 --modes base,active --quantization fp8 --kv-cache-dtype fp8
    ab_decode kv16 kv_$r --batches 64,256,512 --modes base,active --quantization fp8 --kv-cache-dtype fp8
  done
  tar -czf $OUT/ab_kv.tgz -C /tmp $(cd /tmp && ls ab_*kv_*.log)
  exit 0
fi
if [ "$1" = 3 ]; then
  for r in 1 2; do
    for q in bf16 fp8; do
      extra=""; [ $q = fp8 ] && extra="--quantization fp8"
      ab_decode main ${q}_$r --batches 64,256,512 --modes base,active $extra
      ab_decode vec ${q}_$r --batches 64,256,512 --modes base,active $extra
    done
  done
  tar -czf $OUT/ab_vec.tgz -C /tmp $(cd /tmp && ls ab_*.log)
  exit 0
fi
table=$root/benchmarks/session26/moe_tiles_ws.json
[ -f "$table" ] || { echo "no $table: run part 1 and copy its table here first"; exit 2; }
for r in 1 2; do
  for v in shipped ws; do
    tiles=""; [ $v = ws ] && tiles=$table
    (cd $dir && MOESERVE_MOE_TILES=$tiles PYTHONPATH=/tmp/site timeout 130 python3 -m moeserve.bench.prefill \
      --layers 48 --repeats 2 --lora --quantization fp8 --out /tmp/pre_$v$r > /tmp/pre_$v$r.log 2>&1)
    echo "prefill $v$r rc=$? $(( $(date +%s)-t0 ))s: $(grep -E '^  (base|lora) *:' /tmp/pre_$v$r.log | tr -s ' ' | tr '\n' '|')"
  done
done
tar -czf $OUT/logs.tgz -C /tmp $(cd /tmp && ls pre_*.log)
