#!/usr/bin/env bash
# Call 1 (carry .whl): the FP8 expert GEMMs with one weight scale per tile (B_SCALAR: no per-column scale vector
# spread through shared memory with a barrier every K step, one FFMA per element instead of FMUL + FFMA) and weight
# tiles through TMA (offline SASS, Triton 3.6 for sm_90: 64x128x128 4 warps 219 -> 195 -> 168 registers, 2 -> 3 CTAs
# per SM). GPU tests of the FP8 kernels; the W8A8 tile sweep with and without TMA at T = 256 ... 8,192; the decode
# step's per-layer budget at B = 256 with and without adapters (where active LoRA's time goes, #24).
source benchmarks/device_env.sh
t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
LANE_TIMEOUT=100 lane test_kernels_moe_fp8
echo "== sweep at $(( $(date +%s)-t0 ))s"
timeout 330 python3 -m benchmarks.kernels.fp8_moe --out $OUT --parts moe --sweep --sweep-mult fp8_w8a8 \
  --tokens 8192,2048,512,4096,1024,256 > $OUT/sweep.log 2>&1
echo "sweep rc=$? $(( $(date +%s)-t0 ))s"; grep -v "Warn\|warn" $OUT/sweep.log | tail -n 60
python3 - <<'PY'
import json, os
r = json.load(open(os.environ["OUT"] + "/fp8_moe_bench.json"))
for row in r["moe"]:
    sw = {k: v for k, v in row.get("sweep", {}).get("fp8_w8a8", {}).items() if isinstance(v, float)}
    best = sorted(sw, key=sw.get)[:6]
    print(row["tokens"], "bf16", round(row["us"].get("bf16", 0), 1), "w8a8", round(row["us"].get("fp8_w8a8", 0), 1),
          "|", "  ".join(f"{k} {sw[k]:.1f}" for k in best))
PY
echo "== decode profile at $(( $(date +%s)-t0 ))s"
timeout 150 python3 -m moeserve.bench.decode --layers 48 --batches 256 --modes base,active --steps 8 --repeats 1 \
  --profile --profile-modes base,active --out $OUT/decode > $OUT/decode_profile.log 2>&1
echo "decode rc=$? $(( $(date +%s)-t0 ))s"; grep -v "Warn\|warn" $OUT/decode_profile.log | tail -n 70
echo "done at $(( $(date +%s)-t0 )) s"
