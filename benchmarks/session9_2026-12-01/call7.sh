#!/usr/bin/env bash
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site
timeout 45 python3 -m pytest -q -m gpu tests/test_gpu_first_request.py -k "no_request and qwen3 and bfloat16" --tb=short 2>&1 | grep -E "kernels compiled|passed|failed" | cut -c1-1500
timeout 220 python3 -m moeserve.bench.protocol --parts cold --num-prompts 256 --out $OUT/protocol 2>&1 | grep -E "server up|tok/s|cold|run |failed" | tail -12
