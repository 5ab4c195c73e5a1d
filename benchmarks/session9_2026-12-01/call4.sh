#!/usr/bin/env bash
# Device call 4: the GPU tests of every hot-path file, then the prefill protocol on the previous tree (.base).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site
timeout 330 python3 -m pytest -q -m gpu tests/test_kernels_moe.py tests/test_kernels_moe_gate_up.py \
  tests/test_gpu_first_request.py tests/test_gpu_engine.py tests/test_kernels_gemv.py tests/test_kernels_attention_lora.py \
  tests/test_kernels_norm_rotary.py tests/test_kernels_router.py tests/test_memory_fit.py tests/test_prefix_cache.py \
  tests/test_router_lora.py 2>&1 | tee $OUT/gpu_tests.log | grep -E "passed|failed|Error|FAILED|assert" | tail -30
cp moeserve/bench/prefill.py .base/moeserve/bench/prefill.py
(cd .base && timeout 200 python3 -m moeserve.bench.prefill --tag base --repeats 2 --out $OUT 2>&1 | tail -6)
