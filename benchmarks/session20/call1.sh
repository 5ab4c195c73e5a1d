#!/usr/bin/env bash
# Session 20, call 1: what session 19 prepared on the CPU (benchmarks/session19/next_call.sh).
bash benchmarks/session19/next_call.sh
