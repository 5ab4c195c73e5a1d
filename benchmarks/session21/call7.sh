#!/usr/bin/env bash
# Session 21, call 7: calls 4 and 6 ran `python -m` from the repository root, whose directory comes first on sys.path,
# so the "old" runs imported the root's package, not ab_old's: both sides ran the new code. Here the old side runs
# from inside ab_old/ (9e38ee0's package, untracked). FP8 decode at B = 1 and 2, alternated.
source benchmarks/device_env.sh
t0=$(date +%s)
root=$PWD
for round in 1 2; do
  for v in old new; do
    dir=$([ $v = old ] && echo $root/benchmarks/session21/ab_old || echo $root)
    (cd $dir && PYTHONPATH=/tmp/site timeout 45 python3 -c "import moeserve, sys; print('package', moeserve.__file__)" \
      && PYTHONPATH=/tmp/site timeout 45 python3 -m moeserve.bench.decode --layers 48 --batches 1,2 --modes base,active \
      --steps 32 --repeats 1 --quantization fp8 --out /tmp/ab_$v$round) > $OUT/fp8_${v}_$round.log 2>&1
    echo "$v round $round rc=$? $(( $(date +%s)-t0 ))s: $(grep -E '^package|^ +(1|2) ' $OUT/fp8_${v}_$round.log | tr -s ' ' | tr '\n' '|')"
  done
done
