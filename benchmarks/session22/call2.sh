#!/usr/bin/env bash
# Session 22, call 2: session 21's next_call2.sh (FP8 dense tile sweep at 8-512 rows; FP8 step timeline at B = 64,
# 256). Its outputs packed in one archive (a call brings back only a few files).
real_out=$OUT; export OUT=$(mktemp -d)
bash benchmarks/session21/next_call2.sh
tar -czf $real_out/call2.tgz -C $OUT .
