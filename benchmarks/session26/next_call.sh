#!/usr/bin/env bash
# Prepared in session 26 for the next session's first device call (carry [".whl"]): the warp-specialization probe
# for the block-scaled W8A8 GEMM (#25 prefill; BENCHMARKS.md, session 26, "Prepared without device time"), about a
# minute. If `ws` beats `plain` at M = 8,192 by well over the noise (and its bits match), the next step is the MoE
# kernel's activations through TMA (fp8 activations written in the alignment's sorted order) so that the MoE GEMM
# can take `warp_specialize=True`; if not, the W8A8 prefill GEMM stays as it is and #25's prefill target is reported
# as missed with this as the reason.
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 200 python3 benchmarks/session26/ws_probe.py > $OUT/ws_probe.log 2>&1
echo "ws_probe rc=$? $(( $(date +%s)-t0 ))s"; cat $OUT/ws_probe.log | tail -20
