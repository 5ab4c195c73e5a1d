#!/usr/bin/env bash
# A first device call for the session after 19 (not yet run; `bash benchmarks/device_wheels.sh` first, then carry
# .whl): what this session could not measure. Where active LoRA's decode time goes now that the dense LoRA runs on
# rows grouped by slot (session 18's budget: q|k|v +25.2, o +18.6, experts +47.5 µs a layer at B = 256, on the
# tile walk), at B = 256 and 512; then the real server in FP8 with adapters on the grouped dense LoRA (#25's `bench
# serve`; session 19 call 1 measured it on the tile walk: 0.819 of FP8 base). First, the one-launch dense LoRA
# prototype (dense_lora_fused.py, checked on the CPU and compiled for sm_90 only) against the engine's two launches,
# and its store mode (the delta written first, cuBLAS accumulating the base GEMM onto it: one launch fewer, no
# read-modify-write of the output) with the check that decides whether it may be used: is addmm onto zeros bitwise mm?
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 150 python3 benchmarks/session19/dense_lora_fused.py --batches 64,256,512,8192 --block-n 128,256 2>&1 | grep -E "T=|Error|error" \
  | tee $OUT/dense_lora_fused.log
timeout 200 python3 -m moeserve.bench.decode --layers 48 --batches 256,512 --modes base,active --steps 8 --profile \
  --profile-modes base,active --out /tmp/decode_profile > $OUT/decode_profile.log 2>&1
echo "decode profile rc=$? $(( $(date +%s)-t0 ))s"; grep -E "proj|experts|attention|norms|layer" $OUT/decode_profile.log | head -30
timeout $(( 590 - ($(date +%s)-t0) )) python3 -m moeserve.bench.protocol --parts cold --out /tmp/cold_fp8 \
  --server-args "--quantization fp8" > $OUT/protocol_fp8.log 2>&1
echo "protocol fp8 rc=$? $(( $(date +%s)-t0 ))s"; grep -E "run |cold-|base " $OUT/protocol_fp8.log | tail -6
