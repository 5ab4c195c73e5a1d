#!/usr/bin/env bash
# Session 12, last call, on the final tree (carry .whl): every GPU test file in four lanes (memory fit alone after),
# then the serving protocol's base / adapter traffic through `moeserve serve` (Triton's disk cache as the tests left
# it), then FP8 decode with adapters after the one-pass change (#25). Each step under its own limit.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:.
t0=$(date +%s)
lane() { for f in "$@"; do
  s=$(date +%s); timeout 170 python3 -m pytest -q -m gpu tests/$f.py -rf --tb=short -p no:cacheprovider > $OUT/$f.log 2>&1
  echo "$f rc=$? $(( $(date +%s)-s ))s: $(tail -1 $OUT/$f.log)"; done; }
lane test_gpu_first_request &
lane test_kernels_moe test_kernels_moe_gate_up test_kernels_attention_lora &
lane test_gpu_engine test_prefix_cache test_router_lora test_kernels_norm_rotary &
lane test_kernels_moe_fp8 test_kernels_fp8_quant test_kernels_fp8_linear test_gpu_fp8_engine test_kernels_router \
  test_kernels_gemv &
wait
lane test_memory_fit
grep -h -A6 "^FAILED\|^ERROR" $OUT/test_*.log | head -40 | cut -c1-300
echo "== tests done at $(( $(date +%s)-t0 )) s"
timeout 170 python3 -m moeserve.bench.protocol --parts cold --out $OUT/cold 2>&1 | grep -E "server up|compiled|run |cold-" | tail -7
cp $OUT/cold/protocol.json $OUT/serve_protocol.json 2>/dev/null; rm -rf $OUT/cold
echo "== serve done at $(( $(date +%s)-t0 )) s"
left=$(( 575 - $(date +%s) + t0 ))
[ $left -gt 40 ] && timeout $left python3 -m moeserve.bench.decode --layers 48 --batches 64,256,512 --modes base,active \
  --steps 32 --repeats 1 --quantization fp8 --out $OUT/decode_fp8 2>&1 | grep -E "^ +[0-9]+ |B " | sed "s/^/fp8 /"
