#!/usr/bin/env bash
# Session 29 call 2: s28-side-stream in one package, --no-lora-side-stream / on, B = 4, 8, 64, 256, 512
# (bash benchmarks/session28/next_call.sh 2).
bash benchmarks/session28/next_call.sh 2
