#!/usr/bin/env bash
# Session 24, call 5 (the device time left: ~180 s): the activation in the gate_up epilogue on the GPU — its
# bitwise tests, and a first timing at T = 256 and 2,048 (one round, two candidates).
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 85 python3 -m pytest -q -m gpu tests/test_kernels_moe_fp8.py -k "gate_up_epilogue" -p no:cacheprovider \
  > $OUT/act_tests.log 2>&1; echo "tests rc=$? $(( $(date +%s)-t0 ))s: $(tail -1 $OUT/act_tests.log)"
timeout 70 python3 benchmarks/session24/act_in_gate_up.py --out $OUT --tokens 2048,256 --rounds 1 \
  --candidates act_w8s3,act_w4s3 > $OUT/act_sweep.log 2>&1
echo "sweep rc=$? $(( $(date +%s)-t0 ))s"; grep -E "^T |^  T" $OUT/act_sweep.log
