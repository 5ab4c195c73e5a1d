#!/usr/bin/env bash
# Session 25, call 1: session 24's prepared check, as written there (GPU tests of both W8A8 options, then their
# kernel sweep); output in call1/.
bash benchmarks/session24/next_call.sh 1
