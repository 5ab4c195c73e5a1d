#!/usr/bin/env bash
# Call 2 (carry .whl): the dense LoRA kernels with vector loads against the tree before in the kernel bench
# (lora_dense_before.py, made before the call and not kept: `git show 9bff10f:moeserve/kernels/lora_dense.py >
# benchmarks/session18/lora_dense_before.py`); decode by LoRA mode (bf16) on them; GPU tests of the dense LoRA and FP8 kernels;
# prefill with and without adapters, bf16 and FP8 on the new FP8 tiles, with the per-region budget.
source benchmarks/device_env.sh
t0=$(date +%s)
cp moeserve/kernels/lora_dense.py /tmp/lora_dense_new.py
for which in before after; do
  [ $which = before ] && cp benchmarks/session18/lora_dense_before.py moeserve/kernels/lora_dense.py
  [ $which = after ] && cp /tmp/lora_dense_new.py moeserve/kernels/lora_dense.py
  timeout 120 python3 -m benchmarks.kernels.kernels --parts dense_lora --batches 64,256,512 --out /tmp/dl_$which \
    > $OUT/dense_lora_$which.log 2>&1
  echo "dense_lora $which rc=$? $(( $(date +%s)-t0 ))s"; grep -E "^ *(qkv|o) " $OUT/dense_lora_$which.log | grep -E "lora4_r16 |lora8"
done
echo "== decode at $(( $(date +%s)-t0 ))s"
timeout 110 python3 -m moeserve.bench.decode --layers 48 --batches 64,256,512 --modes base,active,mixed --steps 32 \
  --repeats 1 --out /tmp/decode > $OUT/decode.log 2>&1; grep -A6 "^Decode tokens" $OUT/decode.log
echo "== tests at $(( $(date +%s)-t0 ))s"
LANE_TIMEOUT=90 lane test_kernels_attention_lora test_kernels_moe_fp8
for q in fp8 bf16; do
  arg=""; [ $q = fp8 ] && arg="--quantization fp8"
  echo "== prefill $q at $(( $(date +%s)-t0 ))s"
  timeout 130 python3 -m moeserve.bench.prefill --layers 48 --lora --profile --profile-tokens 8192 $arg \
    --out /tmp/prefill_$q > $OUT/prefill_$q.log 2>&1
  echo "rc=$?"; grep -v "Warn\|warn" $OUT/prefill_$q.log | tail -n 22
done
echo "done at $(( $(date +%s)-t0 )) s"
