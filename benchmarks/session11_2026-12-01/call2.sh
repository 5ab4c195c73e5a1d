#!/usr/bin/env bash
# Session 11, call 2: the warm-up that reaches every token-count variant (GPU tests incl. the served shape with
# four adapters), a fresh server's first adapter traffic with Triton's disk cache emptied and again with it kept
# (start-up cold vs warm), and Nsight Compute on the apart LoRA expands at T = 8,192.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:.
rm -rf ~/.triton/cache
timeout 200 python3 -m pytest -q -m gpu tests/test_gpu_first_request.py -k "served_shape or no_request_compiles" \
  tests/test_kernels_fp8_quant.py -rf --tb=short -p no:cacheprovider 2>&1 | grep -v "^\s*$" | tail -12
for start in cold-cache warm-cache; do
  [ $start = cold-cache ] && rm -rf ~/.triton/cache
  timeout 230 python3 -m moeserve.bench.protocol --parts cold --out $OUT/protocol-$start 2>&1 | grep -E "server up|compiled|run |cold-" | tail -8
  grep -h "compiled on the request path" /tmp/moeserve-bench-server-*.log | cut -c1-3000 > $OUT/compiled_$start.log
  rm -f /tmp/moeserve-bench-server-*.log
done
timeout 120 ncu --profile-from-start off --clock-control none --section SpeedOfLight --section LaunchStats \
  --section Occupancy --section MemoryWorkloadAnalysis --section WarpStateStats \
  -k regex:"lora_expand|lora_block_shrink|moe_gate_up|moe_down" \
  python3 benchmarks/session11_2026-12-01/expand_ncu.py > $OUT/expand_ncu.txt 2>&1
grep -E "registers|spills|^  _|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy|Theoretical Occupancy|Stall|L1/TEX Hit|L2 Hit" $OUT/expand_ncu.txt | head -70
