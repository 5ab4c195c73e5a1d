#!/usr/bin/env bash
# Session 12, call 1 (carry .whl .ab): the GPU tests session 11 could not reach (FP8 engine and kernels, prefix
# cache, router LoRA, memory fit) in lanes, then on a quiet GPU: the MoE GEMMs with TMA weight tiles against
# pointer loads (#22), and the apart LoRA expands on main against branch expand-nowhere (.ab/, #24).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:.
lane() { for f in "$@"; do
  s=$(date +%s); timeout 180 python3 -m pytest -q -m gpu tests/$f.py -rf --tb=short -p no:cacheprovider > $OUT/$f.log 2>&1
  echo "$f rc=$? $(( $(date +%s)-s ))s: $(tail -1 $OUT/$f.log)"; done; }
lane test_gpu_fp8_engine &
lane test_kernels_moe_fp8 test_kernels_fp8_quant test_kernels_fp8_linear &
lane test_prefix_cache test_router_lora test_memory_fit &
wait
grep -h -A6 "^FAILED\|^ERROR" $OUT/test_*.log | head -40 | cut -c1-300
echo "== TMA weight tiles"
timeout 240 python3 benchmarks/session12_2026-12-01/moe_tma.py --out $OUT 2>&1 | grep -v Warning | tail -30
echo "== apart expands: main"
timeout 100 python3 benchmarks/session11_2026-12-01/apart_sweep.py --out $OUT 2>&1 | tail -4
echo "== apart expands: expand-nowhere"
mkdir -p $OUT/en; PYTHONPATH=/tmp/site:.ab/expand_nowhere:. timeout 100 python3 benchmarks/session11_2026-12-01/apart_sweep.py --out $OUT/en 2>&1 | tail -4
