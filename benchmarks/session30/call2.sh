#!/usr/bin/env bash
# Session 30 call 2: every GPU-marked test of main ab3dad2 (session 29 merged its hot-path changes with only their
# kernel tests run), in session 28's three lanes at once on the one GPU. Outputs: call2/lanes/.
exec bash benchmarks/session28/call2.sh
