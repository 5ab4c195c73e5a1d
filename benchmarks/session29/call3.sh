#!/usr/bin/env bash
# Session 29 call 3: the GPU tests s28-both touches (both prepared branches as one series), three lanes at once
# (bash benchmarks/session28/next_call.sh 3 both; packages: ab_packages.sh ... both=s28-both, its tests copied in).
bash benchmarks/session28/next_call.sh 3 both
