#!/usr/bin/env bash
# Session 11, last call, on the final tree: first a fresh server's first adapter traffic on a bare machine (Triton's
# disk cache empty: the cold start-up; the again run on other prompts), then every GPU test file in four lanes
# (memory fit alone after), each step under its own limit.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:.
t0=$(date +%s)
rm -rf ~/.triton/cache
timeout 190 python3 -m moeserve.bench.protocol --parts cold --out $OUT/cold 2>&1 | grep -E "server up|compiled|run |cold-" | tail -7
grep -h "warm-up\|compiled on the request path" /tmp/moeserve-bench-server-*.log | cut -c1-2000 > $OUT/server_log_lines.txt
cp $OUT/cold/protocol.json $OUT/cold_protocol.json 2>/dev/null; rm -rf $OUT/cold
echo "== cold done at $(( $(date +%s)-t0 )) s"
lane() { for f in "$@"; do
  s=$(date +%s); timeout 150 python3 -m pytest -q -m gpu tests/$f.py -rf --tb=short -p no:cacheprovider > $OUT/$f.log 2>&1
  echo "$f rc=$? $(( $(date +%s)-s ))s: $(tail -1 $OUT/$f.log)"; done; }
lane test_gpu_engine test_prefix_cache test_router_lora &
lane test_gpu_first_request &
lane test_kernels_moe test_kernels_moe_gate_up test_kernels_attention_lora test_layer_profile &
lane test_kernels_router test_kernels_gemv test_kernels_norm_rotary test_kernels_moe_fp8 test_kernels_fp8_quant \
  test_kernels_fp8_linear test_gpu_fp8_engine &
wait
lane test_memory_fit
grep -h -A6 "^FAILED\|^ERROR" $OUT/test_*.log | head -40 | cut -c1-300
echo "== tests done at $(( $(date +%s)-t0 )) s"
