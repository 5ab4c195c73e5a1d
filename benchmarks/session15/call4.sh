#!/usr/bin/env bash
# Call 4 of session 15 (carry .whl): the served-shape first-request test alone (call 3's lane hit its limit on the
# file's 21st test, this one: the warm-up must compile the in-place LoRA plans' variants), then the serving
# protocol's base and adapter traffic through `moeserve serve` with the time left.
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 170 python3 -m pytest -q -m gpu tests/test_gpu_first_request.py -k served_shape -rf --tb=short \
  -p no:cacheprovider > $OUT/test_gpu_first_request_served_shape.log 2>&1
echo "served_shape rc=$? $(( $(date +%s)-t0 ))s: $(tail -1 $OUT/test_gpu_first_request_served_shape.log)"
left=$(( 400 - $(date +%s) + t0 ))
[ $left -gt 60 ] && timeout $left python3 -m moeserve.bench.protocol --parts cold --out $OUT/cold 2>&1 \
  | grep -E "server up|compiled|run |cold-" | tail -7
cp $OUT/cold/protocol.json $OUT/serve_protocol.json 2>/dev/null; rm -rf $OUT/cold
echo "== serve done at $(( $(date +%s)-t0 )) s"
