#!/usr/bin/env bash
# Session 29 call 6: the merge candidates against main (packages from benchmarks/ab_packages.sh main=HEAD
# v1=s29-final v2=s29-final2): v1 = the side stream beside the FP8 GEMM by default + the expert GEMVs' early reads
# (the FP8 expert GEMV's late wait); v2 = v1 + the pair shrinks' early reads. bench decode B = 1 ... 512, bf16 and
# FP8, one round; then the server protocol (cold, 256 clients) on v1, FP8 and bf16.
source benchmarks/device_env.sh
t0=$(date +%s); root=$PWD
AB_TIMEOUT=150
for q in fp8 bf16; do
  extra=""; [ $q = fp8 ] && extra="--quantization fp8"
  for p in main v1 v2; do ab_decode $p $q --batches 1,2,4,8,64,256,512 --modes base,active,mixed $extra; done
done
tar -czf $OUT/ab.tgz -C /tmp $(cd /tmp && ls ab_*.log)
for q in fp8 bf16; do
  sa=""; [ $q = fp8 ] && sa="--quantization fp8"
  (cd benchmarks/ab/v1 && PYTHONPATH=/tmp/site:. timeout 170 python3 -m moeserve.bench.protocol --parts cold \
    --out /tmp/cold_$q ${sa:+--server-args "$sa"} > $OUT/protocol_v1_$q.log 2>&1)
  echo "protocol v1 $q rc=$? $(( $(date +%s)-t0 ))s"; grep -E "^run |^cold-" $OUT/protocol_v1_$q.log | tail -4
done
echo "done $(( $(date +%s)-t0 ))s"
