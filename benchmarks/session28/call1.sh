#!/usr/bin/env bash
# Session 28 call 1: session 27's prepared A/B, as it ran: bash benchmarks/session27/next_call.sh 1 (bench decode
# B = 1, 2, 4, 8, base / active / mixed, bf16 and FP8, main / s27-producer-shrink, two rounds).
bash benchmarks/session27/next_call.sh 1
