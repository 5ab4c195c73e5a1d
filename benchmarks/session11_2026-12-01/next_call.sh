#!/usr/bin/env bash
# The next session's first device call (carry .whl): the GPU tests the last call of session 11 could not reach
# (FP8 engine and kernels, prefix cache, router LoRA, memory fit), then the first engine-level FP8 numbers: bench
# decode FP8 against bf16 (the #25 targets: >= 1.5 at B = 64, 256, 512; >= 1.3 at B = 1, 8; active/base >= 0.85).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:.
lane() { for f in "$@"; do
  s=$(date +%s); timeout 200 python3 -m pytest -q -m gpu tests/$f.py -rf --tb=short -p no:cacheprovider > $OUT/$f.log 2>&1
  echo "$f rc=$? $(( $(date +%s)-s ))s: $(tail -1 $OUT/$f.log)"; done; }
lane test_gpu_fp8_engine &
lane test_kernels_moe_fp8 test_kernels_fp8_quant test_kernels_fp8_linear &
lane test_prefix_cache test_router_lora &
wait
lane test_memory_fit
grep -h -A6 "^FAILED\|^ERROR" $OUT/test_*.log | head -40 | cut -c1-300
for q in bf16 fp8; do
  extra=""; [ $q = fp8 ] && extra="--quantization fp8"
  timeout 150 python3 -m moeserve.bench.decode --layers 48 --batches 1,8,64,256,512 --modes base,active --steps 32 \
    --repeats 1 $extra --out $OUT/decode_$q 2>&1 | grep -E "^ +[0-9]+ |weights" | sed "s/^/$q /"
done
