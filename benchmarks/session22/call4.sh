#!/usr/bin/env bash
# Session 22, call 4: the FP8 experts' down GEMM apart (W8A8 with its quantization launch against weight-only with
# SiLU*up in the A load, tiles swept), and decode FP8 / bf16 at B = 64, 256, 512 on this tree (A, B, A, B).
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 300 python3 benchmarks/session22/down_parts.py --out $OUT --tokens 64,256,512 > $OUT/down_parts.log 2>&1
echo "down_parts rc=$? $(( $(date +%s)-t0 ))s"; grep -vE "^\s*$|[Ww]arn" $OUT/down_parts.log | tail -40
for round in 1 2; do for q in none fp8; do
  extra=$([ $q = fp8 ] && echo "--quantization fp8")
  timeout 90 python3 -m moeserve.bench.decode --layers 48 --steps 32 --repeats 1 --batches 64,256,512 --modes base \
    $extra --out /tmp/dec_$q$round > $OUT/decode_${q}_$round.log 2>&1
  echo "$q $round rc=$? $(( $(date +%s)-t0 ))s: $(grep -E '^ +[0-9]+ ' $OUT/decode_${q}_$round.log | tr -s ' ' | tr '\n' '|')"
done; done
