#!/usr/bin/env bash
# Session 26 call 2: the FP8 expert gate_up GEMV without activation exchange (s25-expert-gemv) against main at
# B = 1, 2, A, B, A, B; the GPU tests of the bf16 GEMV and expert GEMV branches; the W8A8 tile table with
# group_m = 1 at 512 / 1024 tokens (call 1's down sweep: base within 1 %, with LoRA 5-6 % faster) in bench decode
# B = 256, 512 against the shipped table, A, B, A, B;
# bf16's 512-token row with the down GEMM's group_m = 1 the same way.
source benchmarks/device_env.sh
t0=$(date +%s); root=$PWD
for r in 1 2; do
  ab_decode main fp8_$r --batches 1,2 --modes base,active --quantization fp8
  ab_decode expert fp8_$r --batches 1,2 --modes base,active --quantization fp8
done
for b in bf16gemv:test_kernels_gemv expert:test_kernels_moe_fp8; do
  (cd $root/benchmarks/ab/${b%%:*} && PYTHONPATH=/tmp/site:$root timeout 150 python3 -m pytest -q -m gpu \
    $root/tests/${b##*:}.py -p no:cacheprovider -rf > $OUT/${b%%:*}_tests.log 2>&1)
  echo "$b tests rc=$? $(( $(date +%s)-t0 ))s: $(tail -1 $OUT/${b%%:*}_tests.log)"
done
for r in 1 2; do
  dec_tiles shipped$r "" --batches 256,512 --modes base,active
  dec_tiles g1down$r $root/benchmarks/session26/moe_tiles_g1down.json --batches 256,512 --modes base,active
  dec_tiles g1all$r $root/benchmarks/session26/moe_tiles_g1all.json --batches 256,512 --modes base,active
done
for r in 1 2; do  # bf16: the 512-token row's down GEMM with group_m = 1 (shipped 8)
  for v in shipped bf16g1; do
    tiles=""; [ $v = bf16g1 ] && tiles=$root/benchmarks/session26/moe_tiles_bf16g1.json
    MOESERVE_MOE_TILES=$tiles timeout 80 python3 -m moeserve.bench.decode --layers 48 --steps 32 --repeats 1 \
      --batches 256,512 --modes base,active --out /tmp/dec_bf16_$v$r > /tmp/dec_bf16_$v$r.log 2>&1
    echo "bf16 $v$r rc=$? $(( $(date +%s)-t0 ))s: $(grep -E '^ +[0-9]+ ' /tmp/dec_bf16_$v$r.log | tr -s ' ' | tr '\n' '|')"
  done
done
tar -czf $OUT/logs.tgz -C /tmp $(cd /tmp && ls dec_*.log ab_*.log)
echo "done $(( $(date +%s)-t0 ))s"
