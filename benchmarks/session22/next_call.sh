#!/usr/bin/env bash
# A first device call for the session after 22 (not yet run). Before it, here: `bash benchmarks/device_wheels.sh`
# and `bash benchmarks/session22/prepare_ab.sh`; carry .whl.
# 1. GPU tests of 442e8db (the decode attention writing o_proj's fp8 copy; never run on a GPU) and of the split-K
#    FP8 dense GEMM.
# 2. A/B, each side from inside its own package directory: main / noattn at FP8 B = 64, 256, 512 (where o_proj is
#    W8A8), bf16 at the same B for the ratio, two rounds. Outputs packed in one archive.
source benchmarks/device_env.sh
t0=$(date +%s)
root=$PWD
LANE_TIMEOUT=120 lane test_kernels_attention_lora test_kernels_fp8_linear
LANE_TIMEOUT=130 lane test_gpu_fp8_engine
ab() {  # $1 variant, $2 label, then the decode arguments
  local v=$1 label=$2; shift 2
  (cd $root/benchmarks/session22/ab_$v && PYTHONPATH=/tmp/site timeout 30 python3 -c \
    "import moeserve; print('package', moeserve.__file__)" && PYTHONPATH=/tmp/site timeout 90 python3 -m \
    moeserve.bench.decode --layers 48 --steps 32 --repeats 1 --out /tmp/ab_$v$label "$@") > /tmp/ab_${v}_$label.log 2>&1
  echo "$v $label rc=$? $(( $(date +%s)-t0 ))s: $(grep -E '^package|^ +[0-9]+ ' /tmp/ab_${v}_$label.log | tr -s ' ' | tr '\n' '|')"; }
for round in 1 2; do
  for v in main noattn; do ab $v fp8_$round --batches 64,256,512 --modes base --quantization fp8; done
  ab main bf16_$round --batches 64,256,512 --modes base
done
tar -czf $OUT/ab_logs.tgz -C /tmp $(cd /tmp && ls ab_*.log)
echo "done $(( $(date +%s)-t0 ))s"
