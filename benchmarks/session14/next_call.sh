#!/usr/bin/env bash
# The first device call after session 13 (carry .whl; wheels: bash /work/shared/tools/gpu-wheels.sh pyzmq==27.3.0
# httptools==0.9.0 google-re2==1.1.20251105 into .whl). What session 13 changed after its last GPU run, and what it
# left unmeasured:
# 1. #25: the FP8 GPU tests with --fp8-activations (none against the dequantized path, dynamic close to it), and the
#    FP8 kernel tests, whose oracle (fused_moe_fp8_ref) now runs its sync-free schedule on CUDA.
# 2. #25: FP8 decode with each --fp8-activations setting at B = 1, 8, 64, 256, 512 (auto was measured; none and dynamic
#    not), and FP8 serving (base and adapter traffic) through `moeserve serve --quantization fp8`.
# 3. #24: the MoE-LoRA plan candidates at T = 4,096 and 8,192 (call 1 of session 13: the slot-sorted apart walk
#    2,130 us against the engine plan's 2,330 at 8,192, 939 against 832 at 2,048; 4,096 not measured).
# 4. #22 item 4: bf16 decode at B = 512 with two repeats (call 4: 74 % of the floor, the target 75 %).
source benchmarks/device_env.sh
t0=$(date +%s)
LANE_TIMEOUT=200 lane test_gpu_fp8_engine test_kernels_moe_fp8
for act in auto none dynamic; do
  echo "== decode fp8 $act at $(( $(date +%s)-t0 )) s"
  timeout 100 python3 -m moeserve.bench.decode --layers 48 --batches 1,8,64,256,512 --modes base,active --steps 32 \
    --repeats 1 --quantization fp8 --fp8-activations $act --out $OUT/decode_fp8_$act 2>&1 | grep -E "^ +[0-9]+ |B " \
    | sed "s/^/$act /"
done
echo "== bf16 B=512 at $(( $(date +%s)-t0 )) s"
timeout 60 python3 -m moeserve.bench.decode --layers 48 --batches 512 --modes base --steps 32 --repeats 2 \
  --out $OUT/decode_bf16 2>&1 | grep -E "^ +[0-9]+ " | sed "s/^/bf16 /"
echo "== MoE + LoRA plans at $(( $(date +%s)-t0 )) s"
timeout 120 python3 benchmarks/session13/lora_plans.py --batches 4096,8192 --out $OUT 2>&1 | grep -v Warn | tail -6
left=$(( 570 - $(date +%s) + t0 ))
echo "== FP8 serving at $(( $(date +%s)-t0 )) s"
[ $left -gt 90 ] && timeout $left python3 -m moeserve.bench.protocol --parts cold --server-args "--quantization fp8" \
  --out $OUT/cold_fp8 2>&1 | grep -E "server up|run |cold-" | tail -5
cp $OUT/cold_fp8/protocol.json $OUT/serve_protocol_fp8.json 2>/dev/null; rm -rf $OUT/cold_fp8
