#!/usr/bin/env bash
# A first device call for the session after 21 (not yet run). Before it, here: `bash benchmarks/device_wheels.sh`
# and `bash benchmarks/session21/prepare_ab.sh` (the three packages, untracked, travel with the tree); carry .whl.
# Re-measures the two B = 1 LoRA changes reverted on flawed A/Bs (BENCHMARKS.md session 21): each side runs from
# inside its own package directory and prints which package it imported (from the repository root `python -m`
# imports the root's package ahead of PYTHONPATH). bf16 decode at B = 1 and 8, base and active, A, B, C, A, B, C.
# Then, on main, the FP8 decode table (B = 1 ... 512; the FP8 dense tiles at 8 rows changed in session 21, unmeasured).
source benchmarks/device_env.sh
t0=$(date +%s)
root=$PWD
for round in 1 2; do
  for v in main norm down; do
    (cd $root/benchmarks/session21/ab_$v && PYTHONPATH=/tmp/site timeout 40 python3 -c \
      "import moeserve; print('package', moeserve.__file__)" && PYTHONPATH=/tmp/site timeout 60 python3 -m \
      moeserve.bench.decode --layers 48 --batches 1,8 --modes base,active --steps 32 --repeats 1 \
      --out /tmp/ab_$v$round) > $OUT/ab_${v}_$round.log 2>&1
    echo "$v round $round rc=$? $(( $(date +%s)-t0 ))s: $(grep -E '^package|^ +(1|8) ' $OUT/ab_${v}_$round.log | tr -s ' ' | tr '\n' '|')"
  done
done
timeout $(( 570 - ($(date +%s)-t0) )) python3 -m moeserve.bench.decode --layers 48 --batches 1,8,64,256,512 \
  --modes base,active --steps 32 --repeats 1 --quantization fp8 --out /tmp/fp8 > $OUT/fp8_decode.log 2>&1
echo "fp8 decode rc=$? $(( $(date +%s)-t0 ))s"; grep -A7 "^Decode tokens" $OUT/fp8_decode.log
