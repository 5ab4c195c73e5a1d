#!/usr/bin/env bash
# Session 12, call 2 (carry .whl): the MoE GPU tests on the tree with TMA weight tiles in the table and the apart
# down expand accumulating in place; where the FP8 group quantizer and its twin differ; the tuner with TMA at
# T = 256 and 512 (the rows still above the peer); decode base / active with the table by pointers and by TMA.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:.
S=benchmarks/session12_2026-12-01
( s=$(date +%s); timeout 200 python3 -m pytest -q -m gpu tests/test_kernels_moe.py -rf --tb=short -p no:cacheprovider > $OUT/test_kernels_moe.log 2>&1
  echo "test_kernels_moe rc=$? $(( $(date +%s)-s ))s: $(tail -1 $OUT/test_kernels_moe.log)" ) &
timeout 60 python3 $S/fp8_quant_diag.py 2>&1 | tail -14
wait
grep -h -A8 "^FAILED\|^ERROR\|^____" $OUT/test_kernels_moe.log | head -40 | cut -c1-300
echo "== tune 256,512 (TMA)"
timeout 200 python3 -m benchmarks.kernels.kernels --tune --batches 256,512 --out $OUT 2>&1 | grep -v Warn | tail -8
for tab in pointers tma; do
  if [ $tab = pointers ]; then export MOESERVE_MOE_TILES=$S/moe_tiles_pointers.json; else unset MOESERVE_MOE_TILES; fi
  timeout 110 python3 -m moeserve.bench.decode --layers 48 --batches 256,512 --modes base,active --steps 32 \
    --repeats 1 --out $OUT/decode_$tab 2>&1 | grep -E "^ +[0-9]+ |weights|B " | sed "s/^/$tab /"
done
