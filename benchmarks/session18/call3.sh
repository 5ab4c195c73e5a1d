#!/usr/bin/env bash
# Call 3 (carry .whl): dense LoRA tiles, splits and lanes at T = 256 and 512 (where the q|k|v LoRA still costs twice
# its base GEMM); the FP8 W8A8 GEMMs on the new tiles under Nsight Compute at T = 4,096 (what limits them at 36 % of
# the FP8 peak); FP8 decode on the new FP8 tiles (base, idle-dual, active) against bf16; the real server with
# adapters against base traffic (#24: 0.85).
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 130 python3 -m benchmarks.kernels.kernels --parts dense_lora --batches 256,512 --sweep --out /tmp/dl \
  > $OUT/dense_lora_sweep.log 2>&1
echo "dense sweep rc=$? $(( $(date +%s)-t0 ))s"; grep -E "^ *(qkv|o) .*lora4_r16 |sweep (qkv|o)" $OUT/dense_lora_sweep.log
echo "== ncu at $(( $(date +%s)-t0 ))s"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
timeout 120 $NCU --clock-control none --profile-from-start off -k 'regex:_moe_fp8_gemm' --set full \
  -f -o /tmp/ncu_fp8 python3 -m benchmarks.kernels.ncu_moe --tokens 4096 --fp8 --no-lora > /tmp/ncu_run.log 2>&1
echo "ncu rc=$? $(( $(date +%s)-t0 ))s"; tail -n 3 /tmp/ncu_run.log
$NCU --import /tmp/ncu_fp8.ncu-rep --page details > $OUT/ncu_fp8_t4096_details.txt 2>&1
$NCU --import /tmp/ncu_fp8.ncu-rep --page source --csv --print-source sass > $OUT/ncu_fp8_t4096_source.csv 2>&1
python3 - $OUT/ncu_fp8_t4096_source.csv <<'PY'
import csv, sys  # the SASS lines with the most warp stall samples, per kernel in the report
rows = list(csv.reader(open(sys.argv[1], errors="replace")))
heads = [i for i, r in enumerate(rows) if any("Warp Stall Sampling (All" in c for c in r)]
for h in heads:
    head = rows[h]
    src = next(i for i, c in enumerate(head) if c.strip() == "Source")
    col = next(i for i, c in enumerate(head) if "Warp Stall Sampling (All" in c)
    body = []
    for r in rows[h + 1:]:
        if len(r) <= col or any("Warp Stall Sampling (All" in c for c in r):
            break
        try:
            body.append((float(r[col] or 0), r[src].strip()))
        except ValueError:
            break
    total = sum(v for v, _ in body) or 1
    print(f"-- kernel at row {h}: {len(body)} lines, {total:.0f} samples")
    for v, line in sorted(body, reverse=True)[:18]:
        print(f"  {100 * v / total:5.1f}%  {line[:90]}")
PY
grep -E "^  [_a-z]|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|Issue Slots Busy|Executed Ipc A" \
  $OUT/ncu_fp8_t4096_details.txt | head -40
echo "== fp8 decode at $(( $(date +%s)-t0 ))s"
timeout 170 python3 -m moeserve.bench.decode --layers 48 --batches 64,256,512 --modes base,idle-dual,active --steps 32 \
  --repeats 1 --quantization fp8 --out /tmp/decode_fp8 > $OUT/decode_fp8.log 2>&1
echo "rc=$?"; grep -A6 "^Decode tokens" $OUT/decode_fp8.log
left=$(( 560 - $(date +%s) + t0 ))
echo "== protocol with $left s left"
[ $left -gt 100 ] && timeout $left python3 -m moeserve.bench.protocol --parts cold --out /tmp/cold > $OUT/protocol.log 2>&1
grep -E "server up|compiled|run |cold-" $OUT/protocol.log | tail -7
cp /tmp/cold/protocol.json $OUT/serve_protocol.json 2>/dev/null
echo "done at $(( $(date +%s)-t0 )) s"
