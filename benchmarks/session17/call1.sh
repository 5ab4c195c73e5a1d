#!/usr/bin/env bash
# Call 1: where the in-place MoE LoRA epilogue's time goes at T = 256 (Nsight Compute on the GEMMs and shrinks, with
# and without LoRA: occupancy, stall reasons, per-instruction samples), and whether fewer pipeline stages (more CTAs
# per SM to hide the epilogue's dependent loads) pay, at T = 64 ... 1,024.
source benchmarks/device_env.sh
t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
timeout 240 $NCU --clock-control none --profile-from-start off -k 'regex:_moe_gate_up|_moe_down|_lora_block_shrink' \
  --set full --import-source yes -f -o $OUT/ncu_t256 python3 benchmarks/session17/ncu_lora.py --tokens 256 \
  > $OUT/ncu_run.log 2>&1
echo "ncu rc=$? $(( $(date +%s)-t0 ))s"; tail -n 5 $OUT/ncu_run.log
if [ -f $OUT/ncu_t256.ncu-rep ]; then
  $NCU --import $OUT/ncu_t256.ncu-rep --page details > $OUT/ncu_t256_details.txt 2>&1
  $NCU --import $OUT/ncu_t256.ncu-rep --page raw --csv > $OUT/ncu_t256_raw.csv 2>&1
  $NCU --import $OUT/ncu_t256.ncu-rep --page source --csv --print-source sass > $OUT/ncu_t256_source.csv 2>&1
  ls -la $OUT; grep -E "^  [_a-z]|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Dynamic Shared" \
    $OUT/ncu_t256_details.txt | head -80
fi
echo "== occupancy sweep at $(( $(date +%s)-t0 ))s"
timeout 300 python3 benchmarks/session17/lora_occupancy.py --out $OUT 2>&1 | grep -v Warn
echo "done at $(( $(date +%s)-t0 )) s"
