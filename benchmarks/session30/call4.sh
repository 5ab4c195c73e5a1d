#!/usr/bin/env bash
# Session 30 call 4: main's package (moeserve/ as ab3dad2), bench decode with idle-dual beside base / active / mixed
# at B = 1, 8, 64, 256, 512, bf16 and FP8: #24's idle-LoRA >= 0.99 on the final tree, and FP8 B = 64.
source benchmarks/device_env.sh
t0=$(date +%s)
for q in bf16 fp8; do
  extra=""; [ $q = fp8 ] && extra="--quantization fp8"
  timeout 200 python3 -m moeserve.bench.decode --layers 48 --steps 32 --repeats 1 --batches 1,8,64,256,512 \
    --modes base,idle-dual,active,mixed --out /tmp/dec_$q $extra > $OUT/decode_$q.log 2>&1
  echo "decode $q rc=$? $(( $(date +%s)-t0 ))s"; grep -E "^ +B |^ +[0-9]+ " $OUT/decode_$q.log
done
