#!/usr/bin/env bash
# Session 21, call 2. Call 1's step timeline put the sorted-path LoRA shrinks on the critical path at B = 256 / 512
# (gate_up shrink 29.6 / 45.1 us, down shrink 11.1 / 20.4 us a layer, against ~7 and ~2.6 us of adapter bytes): each
# program walks K = 2,048 (768) in steps of 128, unsplit. 1. `--lora-sweep` at T = 256, 512 on the engine's tuned
# tiles (the sweep ran the heuristic's before), new variants: K-loop pipelining depth, splits with stages, K step 256
# on 8 warps; 2. the best two shrink-only variants per T written as tile tables and run through `bench decode`
# (base, active) against the shipped plans, alternated; 3. the CPU-sized MoE tests on the GPU with TF32 bounds.
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 230 python3 -m benchmarks.kernels.kernels --parts moe --batches 256,512 --lora-sweep --out $OUT/kern \
  > $OUT/kernels_sweep.log 2>&1; echo "sweep rc=$? $(( $(date +%s)-t0 ))s"
grep -A40 -i "lora sweep\|variant" $OUT/kernels_sweep.log | grep -v -i warn | tail -60
python3 benchmarks/session21/variant_tables.py $OUT/kern/kernels_bench.json $OUT/tables
run_decode() {  # $1 label, $2 table file or "" for the shipped one
  MOESERVE_MOE_TILES=$2 timeout 75 python3 -m moeserve.bench.decode --layers 48 --batches 256,512 --modes base,active \
    --steps 32 --repeats 1 --out /tmp/dec_$1 > $OUT/decode_$1.log 2>&1
  echo "$1 rc=$? $(( $(date +%s)-t0 ))s: $(grep -E '^ +(256|512) ' $OUT/decode_$1.log | tr -s ' ' | tr '\n' '|')"; }
run_decode shipped1 ""
run_decode best1_1 $OUT/tables/best1.json
run_decode best2_1 $OUT/tables/best2.json
timeout 90 python3 -m pytest -q tests/test_kernels_moe.py -k "not gpu" -rf --tb=line -p no:cacheprovider \
  > $OUT/moe_cpu_tests_on_gpu.log 2>&1; echo "moe cpu tests on gpu rc=$? $(tail -1 $OUT/moe_cpu_tests_on_gpu.log)"
grep -E "^FAILED|Error" $OUT/moe_cpu_tests_on_gpu.log | head -8
if [ $(( $(date +%s)-t0 )) -lt 440 ]; then run_decode best1_2 $OUT/tables/best1.json; run_decode shipped2 ""; fi
echo "done $(( $(date +%s)-t0 ))s"
