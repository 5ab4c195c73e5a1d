#!/usr/bin/env bash
# Device call 5: the first-request engine tests (details of any failure), the engine's GPU tests, then the prefill
# protocol on this tree with adapters and the per-region budget.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site
timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_first_request.py -k "no_request and (qwen3 or qwen2)" --tb=short -rf \
  2>&1 | tee $OUT/first_request.log | grep -vE "^\s*$" | tail -40
timeout 170 python3 -m pytest -q -m gpu tests/test_gpu_engine.py -rf --tb=line 2>&1 | tee $OUT/gpu_engine.log | tail -8
timeout 200 python3 -m moeserve.bench.prefill --tag new --lora --profile --repeats 2 --out $OUT 2>&1 | tail -9
