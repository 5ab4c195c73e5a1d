#!/usr/bin/env bash
# Session 29 call 1: session 28's prepared A/B as it ran: s28-early-loads vs main, bench decode B = 1, 2, 4, 8
# (base / active / mixed), bf16 and FP8, two rounds (bash benchmarks/session28/next_call.sh 1).
bash benchmarks/session28/next_call.sh 1
