#!/usr/bin/env bash
# Session 26 call 4: bench decode by LoRA mode on the final tree, bf16 / FP8 / bf16 / FP8 (#24, #25 tables).
source benchmarks/device_env.sh
t0=$(date +%s)
for r in 1 2; do for q in bf16 fp8; do
  extra=""; [ $q = fp8 ] && extra="--quantization fp8"
  timeout 150 python3 -m moeserve.bench.decode --layers 48 --steps 32 --repeats 1 --batches 1,8,64,256,512 \
    --modes base,idle-dual,active,mixed $extra --out $OUT/dec_$q$r > $OUT/dec_$q$r.log 2>&1
  echo "$q$r rc=$? $(( $(date +%s)-t0 ))s"; grep -E '^ +[0-9]+ |weights' $OUT/dec_$q$r.log
done; done
