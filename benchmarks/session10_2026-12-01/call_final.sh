#!/usr/bin/env bash
# The session's last device call, on the final tree: every GPU test file (four lanes, memory-fit alone after);
# prefill with and without adapters (the LoRA expands apart at prefill sizes); the FP8 kernels against bf16; a
# fresh server's first adapter traffic (the engine counts the kernels
# compiled after start-up); the decode step if time is left. Each step has its own time limit.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:.
t0=$(date +%s); END=480
left() { echo $(( END - ($(date +%s) - t0) )); }
lane() { for f in "$@"; do
  s=$(date +%s); timeout 190 python3 -m pytest -q -m gpu tests/$f.py -rf --tb=short -p no:cacheprovider > $OUT/$f.log 2>&1
  echo "$f rc=$? $(( $(date +%s)-s ))s: $(tail -1 $OUT/$f.log)"; done; }
lane test_gpu_first_request &
lane test_gpu_engine test_kernels_moe test_kernels_moe_gate_up &
lane test_kernels_router test_kernels_gemv test_kernels_norm_rotary &
lane test_kernels_moe_fp8 test_kernels_fp8_quant test_kernels_fp8_linear test_kernels_attention_lora test_router_lora \
  test_prefix_cache &
wait
lane test_memory_fit
grep -h -A4 "^FAILED\|^ERROR\|Error" $OUT/test_*.log | head -40 | cut -c1-300
echo "== tests done at $(( $(date +%s)-t0 )) s"
timeout 130 python3 -m moeserve.bench.prefill --tag final --lora --repeats 2 --out $OUT 2>&1 | grep -v Warn | tail -5
echo "== prefill done at $(( $(date +%s)-t0 )) s"
timeout 70 python3 -m benchmarks.kernels.fp8_moe --tokens 1,8,64,512,2048,8192 --out $OUT 2>&1 | grep -v Warn | tail -24
echo "== fp8 done at $(( $(date +%s)-t0 )) s"

timeout $(left) python3 -m moeserve.bench.protocol --parts cold --out $OUT/protocol 2>&1 \
  | grep -E "server up|cold|run |compiled" | tail -12
echo "== cold done at $(( $(date +%s)-t0 )) s"
[ "$(left)" -gt 40 ] && timeout $(left) python3 -m moeserve.bench.decode --layers 48 --batches 256,512 \
  --modes base,active --steps 32 --repeats 1 --out $OUT/decode 2>&1 | tail -6
