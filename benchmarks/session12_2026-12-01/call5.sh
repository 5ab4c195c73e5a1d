#!/usr/bin/env bash
# Session 12, call 5 (carry .whl; the session's last device seconds): the FP8 GPU tests on the tree with the LoRA
# expands in the FP8 MoE GEMV epilogues and the FP8 dense GEMV, then decode at small batches bf16 against FP8.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:.
t0=$(date +%s)
lane() { for f in "$@"; do
  s=$(date +%s); timeout 90 python3 -m pytest -q -m gpu tests/$f.py -rf --tb=short -p no:cacheprovider > $OUT/$f.log 2>&1
  echo "$f rc=$? $(( $(date +%s)-s ))s: $(tail -1 $OUT/$f.log)"; done; }
lane test_kernels_fp8_linear test_gpu_fp8_engine &
lane test_kernels_moe_fp8 &
wait
grep -h -A8 "^FAILED\|^ERROR\|^____" $OUT/test_*.log | head -30 | cut -c1-300
for q in bf16 fp8; do
  extra=""; b=1,8; [ $q = fp8 ] && extra="--quantization fp8" && b=1,8,64
  left=$(( 275 - $(date +%s) + t0 ))
  [ $left -gt 20 ] && timeout $left python3 -m moeserve.bench.decode --layers 48 --batches $b --modes base,active --steps 32 \
    --repeats 1 $extra --out $OUT/decode_$q 2>&1 | grep -E "^ +[0-9]+ |B " | sed "s/^/$q /"
done
