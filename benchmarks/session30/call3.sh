#!/usr/bin/env bash
# Session 30 call 3: main ab3dad2 (session 29's final tree, untimed at B >= 256 and through the server): the server
# protocol (cold, 256 clients) bf16 and FP8, then bench decode B = 256, 512 bf16 and FP8.
source benchmarks/device_env.sh
t0=$(date +%s)
for q in bf16 fp8; do
  sa=""; [ $q = fp8 ] && sa="--quantization fp8"
  timeout 170 python3 -m moeserve.bench.protocol --parts cold --out /tmp/cold_$q ${sa:+--server-args "$sa"} \
    > $OUT/protocol_$q.log 2>&1
  echo "protocol $q rc=$? $(( $(date +%s)-t0 ))s"; grep -E "^run |^cold-" $OUT/protocol_$q.log | tail -4
done
AB_TIMEOUT=100
ab_decode main bf16 --batches 256,512 --modes base,active,mixed
ab_decode main fp8 --batches 256,512 --modes base,active,mixed --quantization fp8
echo "done $(( $(date +%s)-t0 ))s"
