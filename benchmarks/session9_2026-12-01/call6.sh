#!/usr/bin/env bash
# Device call 6: no compile after start-up (the family that compiled 8 kernels before do_not_specialize), then the
# serving protocol's `cold` part: a fresh LoRA server, base traffic, the first adapter traffic, the same again.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site
timeout 80 python3 -m pytest -q -m gpu tests/test_gpu_first_request.py -k "no_request and qwen3" --tb=line -rf 2>&1 | tail -4
timeout 340 python3 -m moeserve.bench.protocol --parts cold --out $OUT/protocol 2>&1 | grep -vE "^\s*$" | tail -16
