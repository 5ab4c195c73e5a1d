#!/usr/bin/env bash
# Session 23, call 1 (session 22's next_call.sh with a time guard): GPU tests of 442e8db (the decode attention
# writing o_proj's fp8 copy) and of split-K under PDL / LoRA / graph replays, none run on a GPU before; then
# A/B main / noattn (HEAD with 49d057e and 442e8db reverted) at FP8 B = 64, 256, 512, bf16 beside, two rounds.
source benchmarks/device_env.sh
t0=$(date +%s)
LANE_TIMEOUT=110 lane test_kernels_attention_lora test_kernels_fp8_linear
LANE_TIMEOUT=120 lane test_gpu_fp8_engine
for round in 1 2; do
  [ $(( $(date +%s)-t0 )) -gt 420 ] && { echo "round $round skipped (time)"; break; }
  for v in main noattn; do AB_TIMEOUT=80 ab_decode $v fp8_$round --batches 64,256,512 --modes base --quantization fp8; done
  AB_TIMEOUT=80 ab_decode main bf16_$round --batches 64,256,512 --modes base
done
tar -czf $OUT/ab_logs.tgz -C /tmp $(cd /tmp && ls ab_*.log)
echo "done $(( $(date +%s)-t0 ))s"
