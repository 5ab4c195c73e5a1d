#!/usr/bin/env bash
# Prepared in session 24 for the next session's first device calls: two W8A8 expert-GEMM options no shipped row
# uses yet, the activation in the gate_up epilogue (MoEPlan.act_in_gate_up) and the down GEMM on 16-row parts of
# the 64-row blocks. Run with carry [".whl"], in two calls:
#   bash benchmarks/session24/next_call.sh 1   # GPU tests, then the kernel sweep (writes $OUT/moe_tiles_act.json)
#   cp <files_at>/moe_tiles_act.json benchmarks/session24/; bash benchmarks/session24/next_call.sh 2
#                                               # bench decode and bench prefill, FP8, shipped table / that table
source benchmarks/device_env.sh
t0=$(date +%s)
if [ "${1:-1}" = 1 ]; then
  # the whole FP8 kernel and engine files: the kernel gained both options' branches after session 24's last GPU run
  timeout 240 python3 -m pytest -q -m gpu tests/test_kernels_moe_fp8.py tests/test_gpu_fp8_engine.py \
    -p no:cacheprovider > $OUT/act_tests.log 2>&1
  echo "tests rc=$? $(( $(date +%s)-t0 ))s: $(tail -1 $OUT/act_tests.log)"
  timeout $(( 560 - ($(date +%s)-t0) )) python3 benchmarks/session24/act_in_gate_up.py --out $OUT \
    --tokens 256,512,64,2048,8192 > $OUT/act_sweep.log 2>&1
  echo "sweep rc=$? $(( $(date +%s)-t0 ))s"; grep -E "^T |rows:" $OUT/act_sweep.log
  exit 0
fi
table=$PWD/benchmarks/session24/moe_tiles_act.json
[ -f "$table" ] || { echo "no $table: run part 1 and copy its table here first"; exit 2; }
dec() {  # $1 label, $2 table ("" = shipped), then bench decode's arguments
  local label=$1 tiles=$2; shift 2
  MOESERVE_MOE_TILES=$tiles timeout 80 python3 -m moeserve.bench.decode --layers 48 --steps 32 --repeats 1 \
    --quantization fp8 --out /tmp/dec_$label "$@" > /tmp/dec_$label.log 2>&1
  echo "$label rc=$? $(( $(date +%s)-t0 ))s: $(grep -E '^ +[0-9]+ ' /tmp/dec_$label.log | tr -s ' ' | tr '\n' '|')"; }
for r in 1 2; do
  dec shipped$r "" --batches 64,256,512 --modes base,active
  dec act$r "$table" --batches 64,256,512 --modes base,active
done
for side in shipped act; do
  tiles=""; [ $side = act ] && tiles=$table
  MOESERVE_MOE_TILES=$tiles timeout 120 python3 -m moeserve.bench.prefill --layers 48 --repeats 2 \
    --quantization fp8 --out /tmp/pre_$side > /tmp/pre_$side.log 2>&1
  echo "prefill $side rc=$? $(( $(date +%s)-t0 ))s: $(tail -3 /tmp/pre_$side.log | tr '\n' '|')"
done
tar -czf $OUT/logs.tgz -C /tmp $(cd /tmp && ls dec_*.log pre_*.log)
echo "done $(( $(date +%s)-t0 ))s"
