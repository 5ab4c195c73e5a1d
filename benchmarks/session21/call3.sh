#!/usr/bin/env bash
# Session 21, call 3 (#25: FP8 decode at B = 1 runs as fast as bf16, 2.84 ms both). The GEMVs that serve one row hold
# one tile of a program's loads in flight, and an FP8 tile of bf16's elements holds half bf16's bytes: sweeps of the
# FP8 GEMVs at T = 1, 2 (dense qkv / o through fp8_linear's GEMV, and the routed experts' GEMV path) with tiles of
# more bytes and pipelining; then the FP8 engine's decode step under the profiler at B = 1, 8 (base, active).
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 150 python3 -m benchmarks.kernels.fp8_moe --out $OUT/dense --parts dense --tokens 1,2 --sweep \
  > $OUT/dense_sweep.log 2>&1; echo "dense rc=$? $(( $(date +%s)-t0 ))s"
grep -E "^dense|gemv:|sweep fp8_w:" $OUT/dense_sweep.log
timeout 170 python3 -m benchmarks.kernels.fp8_moe --out $OUT/moe --parts moe --tokens 1,2 --sweep --sweep-mult fp8_w \
  > $OUT/moe_sweep.log 2>&1; echo "moe rc=$? $(( $(date +%s)-t0 ))s"
python3 - $OUT/moe <<'PY'
import json, sys, pathlib
for f in pathlib.Path(sys.argv[1]).glob("*.json"):
    d = json.loads(f.read_text())
    for row in d.get("moe", d.get("rows", [])) if isinstance(d, dict) else []:
        us = row.get("us", {}); sw = row.get("sweep", {}).get("fp8_w", {})
        best = sorted(((v, k) for k, v in sw.items() if isinstance(v, float)))[:8]
        print(f"T={row['tokens']} engine: " + " ".join(f"{k}={v:.1f}" for k, v in us.items() if isinstance(v, float)))
        print("   best: " + " ".join(f"{k}={v:.1f}" for v, k in best))
PY
timeout 200 python3 benchmarks/session20/step_timeline.py --quantization fp8 --batches 1,8 --out $OUT/timeline \
  > $OUT/timeline_fp8.log 2>&1; echo "timeline rc=$? $(( $(date +%s)-t0 ))s"
grep -vE "^\s*$|[Ww]arn" $OUT/timeline_fp8.log | tail -75
