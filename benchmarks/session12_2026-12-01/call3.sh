#!/usr/bin/env bash
# Session 12, call 3 (carry .whl): the routed-expert rows T = 1 ... 8,192 on the final table (pointers and TMA, #22);
# prefill base and with adapters (#22 item 3); decode bf16 against FP8 base weights at B = 1 ... 512 (#25).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:.
S=benchmarks/session12_2026-12-01
echo "== MoE rows"
timeout 150 python3 $S/moe_tma.py --out $OUT --only-tma --batches 1,8,64,256,512,1024,2048,4096,8192 \
  --lora-batches 64,256,512,2048,8192 2>&1 | grep -v Warn | tail -16
echo "== prefill"
timeout 170 python3 -m moeserve.bench.prefill --preset qwen3-30b-a3b --layers 48 --lora --repeats 2 --out $OUT/prefill 2>&1 \
  | grep -v Warn | tail -8
for q in bf16 fp8; do
  extra=""; [ $q = fp8 ] && extra="--quantization fp8"
  timeout 130 python3 -m moeserve.bench.decode --layers 48 --batches 1,8,64,256,512 --modes base,active --steps 32 \
    --repeats 1 $extra --out $OUT/decode_$q 2>&1 | grep -E "^ +[0-9]+ |weights|B " | sed "s/^/$q /"
done
