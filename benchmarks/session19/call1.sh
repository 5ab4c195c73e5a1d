#!/usr/bin/env bash
# Session 19, call 1: session 18's next_call.sh as it was prepared, run on tree 84b0749 (its prototype
# dense_lora_grouped.py is in that commit; it became kernels/lora_dense.py in fd183af and left the session folder).
bash benchmarks/session18/next_call.sh
