#!/usr/bin/env bash
# Call 4 (carry .whl; pydantic-core now the version pydantic 2.13.4 requires): the W8A8 GEMMs with the scales loaded
# a K step ahead (call 3's Nsight Compute: a quarter of the stall samples waited on them), with and without the
# register cap; GPU tests of the engine paths this session's kernels reach (FP8 engine: graphs vs eager, nolora graph
# bitwise the LoRA-disabled FP8 engine, mixed adapter batches; bf16 engine: attention LoRA on the vectorized dense
# kernels, 32-token tiles at T >= 256; PDL launches; the FP8 kernels; the first request's served shape); then the
# real server with adapters against base traffic (#24: 0.85) in what time is left.
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 90 python3 benchmarks/session18/fp8_regs.py 2>&1 | grep -E "^T=|Error|error" | tee $OUT/fp8_regs.log
echo "== tests at $(( $(date +%s)-t0 ))s"
LANE_TIMEOUT=80 lane test_kernels_moe_fp8
LANE_TIMEOUT=105 lane test_gpu_fp8_engine test_gpu_engine
LANE_TIMEOUT=40 lane test_pdl_launches
timeout 75 python3 -m pytest -q -m gpu tests/test_gpu_first_request.py -k served_shape -rf --tb=short \
  -p no:cacheprovider > $OUT/test_gpu_first_request_served_shape.log 2>&1
echo "served_shape rc=$? $(( $(date +%s)-t0 ))s: $(tail -n 1 $OUT/test_gpu_first_request_served_shape.log)"
left=$(( 555 - $(date +%s) + t0 ))
echo "== protocol with $left s left"
[ $left -gt 100 ] && timeout $left python3 -m moeserve.bench.protocol --parts cold --out /tmp/cold > $OUT/protocol.log 2>&1
grep -E "server up|compiled|run |cold-|base " $OUT/protocol.log | tail -8
echo "done at $(( $(date +%s)-t0 )) s"
