#!/usr/bin/env bash
# The first device call of the next session (carry .whl, and .base for the A/B rows): every GPU test file, with
# failures named; then a fresh server's first adapter traffic with the adapter preload; then bench decode on this
# tree. Each step has its own time limit so one slow step cannot eat the others' output.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site
for f in test_gpu_first_request test_kernels_moe test_kernels_moe_gate_up test_gpu_engine test_kernels_gemv \
         test_kernels_attention_lora test_kernels_norm_rotary test_kernels_router test_memory_fit test_prefix_cache \
         test_router_lora; do
  timeout 150 python3 -m pytest -q -m gpu tests/$f.py -rf --tb=line 2>&1 | tail -4 | sed "s/^/$f: /"
done | tee $OUT/gpu_tests.log
timeout 300 python3 -m moeserve.bench.protocol --parts cold --out $OUT/protocol 2>&1 | grep -E "server up|run |cold" | tail -8
timeout 300 python3 -m moeserve.bench.decode --layers 48 --batches 1,8,64,256,512 --modes base,idle-dual,active,mixed \
  --steps 32 --repeats 1 --out $OUT/decode 2>&1 | tail -12
