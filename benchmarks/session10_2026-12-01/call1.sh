#!/usr/bin/env bash
# Every GPU test file on the H200, three lanes at once (kernel compiles are CPU-bound; 16 cores), memory-fit alone
# after (it sizes the KV cache from free memory). Failures named with -rf.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site
lane() { for f in "$@"; do
  s=$(date +%s); timeout 400 python3 -m pytest -q -m gpu tests/$f.py -rf --tb=short -p no:cacheprovider > $OUT/$f.log 2>&1
  echo "$f rc=$? $(( $(date +%s)-s ))s: $(tail -1 $OUT/$f.log)"; done; }
lane test_gpu_first_request test_gpu_engine &
lane test_kernels_moe test_kernels_moe_gate_up test_kernels_gemv &
lane test_kernels_attention_lora test_kernels_norm_rotary test_kernels_router test_router_lora test_prefix_cache test_layer_profile &
wait
lane test_memory_fit
