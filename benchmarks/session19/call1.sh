#!/usr/bin/env bash
# Session 19, call 1: session 18's next_call.sh as it ran, on tree 84b0749 (the prototype dense_lora_grouped.py is
# in that commit; it became kernels/lora_dense.py in fd183af and was removed from the session folder after).
# A first device call for the session after 18 (not yet run; `bash benchmarks/device_wheels.sh` first, then carry
# .whl): what this session could not measure. The real server with adapters against base traffic (#24: 0.85; the
# attention LoRA's vector loads and 32-token tiles since the last serving run), bf16 then FP8 (#25's `bench serve`,
# FP8 vs bf16); decode by LoRA mode on the 32-token dense LoRA tiles (B = 1 ... 512); the FP8 engine's GPU tests on
# the final FP8 kernel (call 4 ran them on the scale-prefetch variant that was backed out); the prototype dense LoRA
# on rows grouped by slot (dense_lora_grouped.py) against the engine's, T = 64 ... 512 (checked on the CPU only).
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 100 python3 benchmarks/session18/dense_lora_grouped.py --batches 64,256,512 2>&1 | grep -E "T=|Error|error" \
  | tee $OUT/dense_lora_grouped.log
timeout 170 python3 -m moeserve.bench.protocol --parts cold --out /tmp/cold > $OUT/protocol_bf16.log 2>&1
echo "protocol bf16 rc=$? $(( $(date +%s)-t0 ))s"; grep -E "run |cold-|base " $OUT/protocol_bf16.log | tail -6
timeout 200 python3 -m moeserve.bench.protocol --parts cold --out /tmp/cold_fp8 --server-args "--quantization fp8" \
  > $OUT/protocol_fp8.log 2>&1
echo "protocol fp8 rc=$? $(( $(date +%s)-t0 ))s"; grep -E "run |cold-|base " $OUT/protocol_fp8.log | tail -6
timeout 120 python3 -m moeserve.bench.decode --layers 48 --batches 1,8,64,256,512 --modes base,active,mixed --steps 32 \
  --repeats 1 --out /tmp/decode > $OUT/decode.log 2>&1; grep -A8 "^Decode tokens" $OUT/decode.log
LANE_TIMEOUT=100 lane test_gpu_fp8_engine
echo "done at $(( $(date +%s)-t0 )) s"
