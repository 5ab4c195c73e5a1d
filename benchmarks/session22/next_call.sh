#!/usr/bin/env bash
# A first device call for the session after 22 (not yet run). Before it, here: `bash benchmarks/device_wheels.sh`
# and `bash benchmarks/ab_packages.sh main=HEAD noattn=HEAD~442e8db`; carry [".whl", "benchmarks/ab"].
# 1. GPU tests of 442e8db (the decode attention writing o_proj's fp8 copy) and of split-K (21701a7's test under PDL,
#    the LoRA epilogue and graph replays); none of them has run on a GPU.
# 2. A/B: main / noattn at FP8 B = 64, 256, 512 (where o_proj is W8A8), bf16 at the same B for the ratio, two rounds.
#    If noattn wins, revert 442e8db.
source benchmarks/device_env.sh
t0=$(date +%s)
LANE_TIMEOUT=120 lane test_kernels_attention_lora test_kernels_fp8_linear
LANE_TIMEOUT=130 lane test_gpu_fp8_engine
for round in 1 2; do
  for v in main noattn; do ab_decode $v fp8_$round --batches 64,256,512 --modes base --quantization fp8; done
  ab_decode main bf16_$round --batches 64,256,512 --modes base
done
tar -czf $OUT/ab_logs.tgz -C /tmp $(cd /tmp && ls ab_*.log)
echo "done $(( $(date +%s)-t0 ))s"
