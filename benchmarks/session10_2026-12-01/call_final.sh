#!/usr/bin/env bash
# The session's last device call, on the final tree: every GPU test file (four lanes, memory-fit alone after);
# prefill with and without adapters (the LoRA expands apart at prefill sizes); a fresh server's first adapter
# traffic with Triton's on-disk cache emptied first (the engine now counts kernels compiled after start-up);
# the decode step. Each step has its own time limit.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site
t0=$(date +%s)
lane() { for f in "$@"; do
  s=$(date +%s); timeout 200 python3 -m pytest -q -m gpu tests/$f.py -rf --tb=short -p no:cacheprovider > $OUT/$f.log 2>&1
  echo "$f rc=$? $(( $(date +%s)-s ))s: $(tail -1 $OUT/$f.log)"; done; }
lane test_gpu_first_request &
lane test_gpu_engine test_kernels_moe test_kernels_moe_gate_up &
lane test_kernels_router test_kernels_gemv test_kernels_norm_rotary &
lane test_kernels_attention_lora test_router_lora test_prefix_cache &
wait
lane test_memory_fit
grep -h -A3 "^FAILED\|^ERROR" $OUT/test_*.log | head -30
echo "== tests done at $(( $(date +%s)-t0 )) s"
timeout 140 python3 -m moeserve.bench.prefill --tag final --lora --repeats 2 --out $OUT 2>&1 | grep -v Warn | tail -5
echo "== prefill done at $(( $(date +%s)-t0 )) s"
rm -rf ~/.triton/cache
timeout 130 python3 -m moeserve.bench.protocol --parts cold --out $OUT/protocol 2>&1 | grep -E "server up|cold|run |compiled" | tail -12
echo "== cold done at $(( $(date +%s)-t0 )) s"
timeout $(( 575 - ($(date +%s)-t0) )) python3 -m moeserve.bench.decode --layers 48 --batches 1,64,256,512 \
  --modes base,active,mixed --steps 32 --repeats 1 --out $OUT/decode 2>&1 | tail -8
