#!/usr/bin/env bash
# A first device call for the session after 19 (not yet run; `bash benchmarks/device_wheels.sh` first, then carry
# .whl). Three things this session prepared on the CPU only:
# 1. the one-launch dense LoRA prototype (dense_lora_fused.py, checked on the CPU, compiled for sm_90) against the
#    engine's two launches, and its store mode (the delta written first, cuBLAS accumulating the base GEMM onto it:
#    one launch fewer, no read-modify-write of the output) with the check that decides whether it may be used: is
#    addmm onto zeros bitwise mm?
# 2. the prefill attention's tile sweep (benchmarks/kernels/prefill_attention.py; PrefillTile, the causal mask only
#    where a step needs it): the prefill forward's attention runs ~9x its compute floor; and the GPU tests of the new
#    tiles (test_kernels_attention_lora);
# 3. where active LoRA's decode time goes now (session 18's budget was on the tile walk), at B = 256 and 512.
# Then next_call2.sh: the real server in FP8 with adapters.
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 150 python3 benchmarks/session19/dense_lora_fused.py --batches 64,256,512,8192 --block-n 128,256 2>&1 \
  | grep -E "T=|Error|error" | tee $OUT/dense_lora_fused.log
echo "== prefill attention at $(( $(date +%s)-t0 ))s"
timeout 150 python3 -m benchmarks.kernels.prefill_attention --out /tmp/pa --sweep > $OUT/prefill_attention.log 2>&1
echo "rc=$?"; cat $OUT/prefill_attention.log | grep -v "^\s*$" | head -50
LANE_TIMEOUT=60 lane test_kernels_attention_lora
echo "== decode profile at $(( $(date +%s)-t0 ))s"
timeout $(( 590 - ($(date +%s)-t0) )) python3 -m moeserve.bench.decode --layers 48 --batches 256,512 --modes base,active \
  --steps 8 --profile --profile-modes base,active --out /tmp/decode_profile > $OUT/decode_profile.log 2>&1
echo "decode profile rc=$? $(( $(date +%s)-t0 ))s"; grep -E "proj|experts|attention|norms|layer" $OUT/decode_profile.log | head -30
