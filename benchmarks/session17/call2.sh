#!/usr/bin/env bash
# Call 2: the LoRA expands' B tiles loaded as 16-byte vectors (masked at the pool's rank, not the slot's): Nsight
# Compute's registers and durations of the T = 256 LoRA GEMMs again, the routed experts with and without 4 adapters
# at T = 16 ... 8,192, `bench decode` base / active, and the GPU tests of the files the change reaches.
source benchmarks/device_env.sh
t0=$(date +%s)
NCU=/usr/local/cuda/bin/ncu
timeout 120 $NCU --clock-control none --profile-from-start off -k 'regex:_moe_gate_up|_moe_down' \
  --section LaunchStats --section SpeedOfLight --section WarpStateStats --section SourceCounters --import-source yes \
  -f -o $OUT/ncu_t256 python3 benchmarks/session17/ncu_lora.py --tokens 256 > $OUT/ncu_run.log 2>&1
$NCU --import $OUT/ncu_t256.ncu-rep --page details > $OUT/ncu_t256_details.txt 2>&1
$NCU --import $OUT/ncu_t256.ncu-rep --page source --csv --print-source sass > $OUT/ncu_t256_source.csv 2>&1
grep -E "^  [_a-z]|Duration|Registers Per" $OUT/ncu_t256_details.txt
grep -c "LDG.E.U16" $OUT/ncu_t256_source.csv; grep -c "LDG.E.128" $OUT/ncu_t256_source.csv
rm -f $OUT/ncu_t256.ncu-rep
echo "== experts at $(( $(date +%s)-t0 ))s"
timeout 150 python3 benchmarks/session16/lora_inplace.py --out $OUT --candidates engine \
  --batches 16,64,256,512,1024,2048,4096,8192 2>&1 | tee $OUT/lora_engine.txt | grep -E "^T="
echo "== decode at $(( $(date +%s)-t0 ))s"
timeout 170 python3 -m moeserve.bench.decode --layers 48 --batches 1,8,64,256,512 --modes base,active --steps 32 \
  --repeats 1 --out $OUT/decode 2>&1 | grep -E "^ +[0-9]+ |Error|error|^ +B "
echo "== tests at $(( $(date +%s)-t0 ))s"
LANE_TIMEOUT=130 lane test_kernels_moe test_kernels_moe_gate_up
echo "done at $(( $(date +%s)-t0 )) s"
