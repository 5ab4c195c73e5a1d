#!/usr/bin/env bash
# Call 5 (carry .whl): the MoE LoRA in place at every size (bf16 and FP8). GPU tests of the files it reaches (the MoE
# kernels, the first request's served shape — the warm-up must compile the in-place prefill variants — the FP8
# engine, the engine), then the serving protocol with adapters on what time is left.
source benchmarks/device_env.sh
t0=$(date +%s)
LANE_TIMEOUT=150 lane test_kernels_moe test_gpu_fp8_engine
timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_first_request.py -k served_shape -rf --tb=short \
  -p no:cacheprovider > $OUT/test_gpu_first_request_served_shape.log 2>&1
echo "served_shape rc=$? $(( $(date +%s)-t0 ))s: $(tail -1 $OUT/test_gpu_first_request_served_shape.log)"
LANE_TIMEOUT=100 lane test_gpu_engine
left=$(( 560 - $(date +%s) + t0 ))
echo "== protocol with $left s left"
[ $left -gt 90 ] && timeout $left python3 -m moeserve.bench.protocol --parts cold --out $OUT/cold 2>&1 \
  | grep -E "server up|compiled|run |cold-" | tail -7
cp $OUT/cold/protocol.json $OUT/serve_protocol.json 2>/dev/null; rm -rf $OUT/cold
echo "done at $(( $(date +%s)-t0 )) s"
