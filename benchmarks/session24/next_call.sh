#!/usr/bin/env bash
# Prepared in session 24 for the next session's first device call: the W8A8 activation in the gate_up epilogue
# (MoEPlan.act_in_gate_up, off in the shipped table): its GPU tests (bitwise the separate launch), the kernel
# sweep at T = 16 ... 8,192 (writes a table with the winners), then bench decode and bench prefill, FP8, shipped
# table / that table, A, B, A, B.
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 200 python3 -m pytest -q -m gpu tests/test_kernels_moe_fp8.py -k "gate_up_epilogue" -p no:cacheprovider \
  > $OUT/act_tests.log 2>&1; echo "tests rc=$? $(( $(date +%s)-t0 ))s: $(tail -1 $OUT/act_tests.log)"
timeout 240 python3 benchmarks/session24/act_in_gate_up.py --out $OUT > $OUT/act_sweep.log 2>&1
echo "sweep rc=$? $(( $(date +%s)-t0 ))s"; grep -E "^T |fused rows" $OUT/act_sweep.log
dec() {  # $1 label, $2 table ("" = shipped), then bench decode's arguments
  local label=$1 table=$2; shift 2
  MOESERVE_MOE_TILES=$table timeout 80 python3 -m moeserve.bench.decode --layers 48 --steps 32 --repeats 1 \
    --quantization fp8 --out /tmp/dec_$label "$@" > /tmp/dec_$label.log 2>&1
  echo "$label rc=$? $(( $(date +%s)-t0 ))s: $(grep -E '^ +[0-9]+ ' /tmp/dec_$label.log | tr -s ' ' | tr '\n' '|')"; }
for r in 1 2; do
  dec shipped$r "" --batches 64,256,512 --modes base,active
  dec act$r $OUT/moe_tiles_act.json --batches 64,256,512 --modes base,active
done
for side in shipped act; do
  table=""; [ $side = act ] && table=$OUT/moe_tiles_act.json
  MOESERVE_MOE_TILES=$table timeout 120 python3 -m moeserve.bench.prefill --layers 48 --repeats 2 \
    --quantization fp8 --out /tmp/pre_$side > /tmp/pre_$side.log 2>&1
  echo "prefill $side rc=$? $(( $(date +%s)-t0 ))s: $(tail -3 /tmp/pre_$side.log | tr '\n' '|')"
done
tar -czf $OUT/logs.tgz -C /tmp $(cd /tmp && ls dec_*.log pre_*.log)
echo "done $(( $(date +%s)-t0 ))s"
