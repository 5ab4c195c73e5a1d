#!/usr/bin/env bash
# Session 11, call 3: the served-shape compile test after the warm-up reaches the step budget; a fresh server's first
# adapter traffic with Triton's disk cache emptied (the #21 target); the redesign's same-run A/B (#23: the tree
# before it, 94780e0, carried in .ab/old, against this one: bench decode base/active and bench serve base); the
# apart expand sweep at T = 8,192.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:.
rm -rf ~/.triton/cache
timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_first_request.py -k "served_shape" -rf --tb=short \
  -p no:cacheprovider 2>&1 | grep -E "passed|failed|Error|compiled" | cut -c1-3000 | tail -6
rm -rf ~/.triton/cache
timeout 260 python3 -m moeserve.bench.protocol --parts cold --out $OUT/cold 2>&1 | grep -E "server up|compiled|run |cold-" | tail -6
grep -h "compiled on the request path" /tmp/moeserve-bench-server-*.log | cut -c1-3000 > $OUT/compiled_cold.log
rm -f /tmp/moeserve-bench-server-*.log
for tree in new old; do
  dir=.; [ $tree = old ] && dir=.ab/old
  (cd $dir && PYTHONPATH=/tmp/site:. timeout 100 python3 -m moeserve.bench.decode --layers 48 --batches 64,256 \
    --modes base,active --steps 32 --repeats 1 --out $OUT/ab-decode-$tree 2>&1 | grep -E "^ +(64|256) " | sed "s/^/$tree /")
done
for tree in new old; do
  dir=.; [ $tree = old ] && dir=.ab/old
  (cd $dir && PYTHONPATH=/tmp/site:. timeout 150 python3 -m moeserve.bench.protocol --parts base --out $OUT/ab-serve-$tree 2>&1 \
    | grep -E "server up|^base " | sed "s/^/$tree /")
done
timeout 120 python3 benchmarks/session11_2026-12-01/apart_sweep.py --batches 8192 --out $OUT 2>&1 | tail -4
