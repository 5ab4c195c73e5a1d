#!/usr/bin/env bash
# Session 22, call 1: session 21's next_call.sh as it stands (GPU tests of a33518f / b3bfdc0 / f5ffe41, then the
# A/Bs of the packages benchmarks/session21/prepare_ab.sh builds).
bash benchmarks/session21/next_call.sh
