#!/usr/bin/env bash
# Session 30 call 1: session 29's prepared A/B of the in-grid LoRA shrink (branch s29-grid-shrink), run as it was
# written, with the packages made here by
#   bash benchmarks/ab_packages.sh main=HEAD grid1=508acdc grid2=s29-grid-shrink
# (grid1 = the branch's first commit, the dense GEMV alone; next_call.sh's own `s29-grid-shrink~5` would have read as
# "revert commit 5", which ab_packages.sh now refuses). Outputs: call1/ab_*.log.
exec bash benchmarks/session29/next_call.sh 1
