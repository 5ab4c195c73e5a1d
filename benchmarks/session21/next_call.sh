#!/usr/bin/env bash
# A first device call for the session after 21 (not yet run). Before it, here: `bash benchmarks/device_wheels.sh`
# and `bash benchmarks/session21/prepare_ab.sh` (the packages in ab_*/, untracked, travel with the tree); carry .whl.
# 1. The GPU tests of session 21's FP8 changes never run on a GPU (a33518f: the dense LoRA expand in the FP8
#    product's epilogue; b3bfdc0 / f5ffe41: the norms writing the fp8 x the W8A8 experts / q|k|v read).
# 2. A/Bs, each side run from inside its own package directory, printing which package it imported (from the
#    repository root `python -m` imports the root's package ahead of PYTHONPATH: BENCHMARKS.md, session 21):
#    base / norm / down (bf16 B = 1, 8: session 20's two B = 1 LoRA changes, reverted on runs that proved nothing);
#    base / fp8pre (FP8 B = 1, 2, active: the epilogue); main / fp8quant (FP8 B = 64, 256: the norms' fp8 copies).
# ~540 s; the FP8 dense tile sweep at 8-512 rows (new narrow candidates) is next_call2.sh.
source benchmarks/device_env.sh
t0=$(date +%s)
root=$PWD
LANE_TIMEOUT=60 lane test_kernels_fp8_linear test_kernels_norm_rotary
LANE_TIMEOUT=120 lane test_gpu_fp8_engine
ab() {  # $1 variant, $2 label, then the decode arguments
  local v=$1 label=$2; shift 2
  (cd $root/benchmarks/session21/ab_$v && PYTHONPATH=/tmp/site timeout 30 python3 -c \
    "import moeserve; print('package', moeserve.__file__)" && PYTHONPATH=/tmp/site timeout 60 python3 -m \
    moeserve.bench.decode --layers 48 --steps 32 --repeats 1 --out /tmp/ab_$v$label "$@") > $OUT/ab_${v}_$label.log 2>&1
  echo "$v $label rc=$? $(( $(date +%s)-t0 ))s: $(grep -E '^package|^ +[0-9]+ ' $OUT/ab_${v}_$label.log | tr -s ' ' | tr '\n' '|')"; }
for round in 1 2; do
  for v in base norm down; do ab $v bf16_$round --batches 1,8 --modes base,active; done
  for v in base fp8pre; do ab $v fp8lora_$round --batches 1,2 --modes base,active --quantization fp8; done
  for v in main fp8quant; do ab $v fp8quant_$round --batches 64,256 --modes base --quantization fp8; done
done
echo "done $(( $(date +%s)-t0 ))s"
