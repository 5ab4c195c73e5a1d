#!/usr/bin/env bash
# Session 21, call 1: session 20's next_call.sh as prepared (the step timeline at B = 1, 8, 256, 512; the FP8
# swap-AB prototype; the CPU-sized MoE tests on the GPU; the FP8 server).
exec bash benchmarks/session20/next_call.sh
