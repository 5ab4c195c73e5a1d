#!/usr/bin/env bash
# The next session's first device call (carry .whl): the FP8 GPU tests (never run on the GPU: they lacked the gpu
# mark in session 10) and the MoE ones (the review's last kernel refactor ran on CPU only), a fresh server's first adapter traffic with Triton's disk cache emptied, printing the
# specialization of each kernel compiled on the request path (session 10 saw 12: _align_place_kernel,
# _moe_gate_up_kernel, dense LoRA _shrink_kernel / _expand_kernel), then the decode modes session 10 skipped.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:.
timeout 260 python3 -m pytest -q -m gpu tests/test_kernels_moe_fp8.py tests/test_kernels_fp8_quant.py \
  tests/test_kernels_fp8_linear.py tests/test_kernels_moe.py tests/test_kernels_moe_gate_up.py -rf --tb=short -p no:cacheprovider 2>&1 | tail -15
rm -rf ~/.triton/cache
timeout 240 python3 -m moeserve.bench.protocol --parts cold --out $OUT/protocol 2>&1 | grep -E "server up|cold|run |compiled" | tail -12
grep -h "compiled on the request path" /tmp/moeserve-bench-server-*.log | cut -c1-1200 > $OUT/compiled_variants.log
timeout 150 python3 -m moeserve.bench.decode --layers 48 --batches 1,8,64 --modes base,idle-dual,active,mixed \
  --steps 32 --repeats 1 --out $OUT/decode 2>&1 | tail -8
