#!/usr/bin/env bash
# Session 27 call 2: session 26's next_call.sh part 1 as it stood (outputs in call2/):
#   bash benchmarks/ab_packages.sh main=main sorted=s26-act-sorted vec=s26-expand-vec
#   git archive s26-act-sorted tests | tar -x -C benchmarks/ab/sorted
#   bash benchmarks/session26/next_call.sh 1        # carry [".whl", "benchmarks/ab"]
# Every step ran into its limit: the probe timed two of its shapes in 150 s (its compiles are slow), the branch's GPU
# tests passed 5 before 150 s, the tile sweep wrote nothing in the ~260 s left.
exec bash benchmarks/session26/next_call.sh 1
