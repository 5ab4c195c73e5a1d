#!/usr/bin/env bash
# Call 4 (tree f6bc547: vector B loads, the in-place walk in bf16 and FP8): `bench decode` base / active / mixed at
# B = 1 ... 512, the FP8 experts with and without LoRA, and the serving protocol with adapters (a fresh server).
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 230 python3 -m moeserve.bench.decode --layers 48 --batches 1,8,64,256,512 --modes base,active,mixed \
  --steps 32 --repeats 1 --out $OUT/decode 2>&1 | grep -E "^ +[0-9]+ |Error|error|^ +B "
echo "== fp8 at $(( $(date +%s)-t0 ))s"
timeout 100 python3 benchmarks/session17/fp8_walk.py --out $OUT 2>&1 | grep -E "^FP8|Error|error"
left=$(( 570 - $(date +%s) + t0 ))
echo "== protocol with $left s left"
[ $left -gt 90 ] && timeout $left python3 -m moeserve.bench.protocol --parts cold --out $OUT/cold 2>&1 \
  | grep -E "server up|compiled|run |cold-" | tail -7
cp $OUT/cold/protocol.json $OUT/serve_protocol.json 2>/dev/null; rm -rf $OUT/cold
echo "done at $(( $(date +%s)-t0 )) s"
