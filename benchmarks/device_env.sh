# Sourced by the device-call scripts (run with `carry: [".whl"]`; benchmarks/device_wheels.sh fills .whl/ with the
# wheels the device lacks, at .venv's versions): those wheels installed beside
# the tree, the tree on the path, `lane FILE...` (GPU-marked tests of tests/FILE.py one after another, each
# under LANE_TIMEOUT seconds, its log in $OUT/FILE.log and one summary line printed), and `ab_decode NAME LABEL
# ARGS...` (bench decode from inside benchmarks/ab/NAME, the package benchmarks/ab_packages.sh built: carry
# "benchmarks/ab" too; its log in /tmp/ab_NAME_LABEL.log, one line printed with the package it imported), and
# `dec_tiles LABEL TABLE ARGS...` / `pre_tiles LABEL TABLE` (bench decode / bench prefill FP8 of the tree with
# MOESERVE_MOE_TILES=TABLE, "" = the shipped table; the log in /tmp/dec_LABEL.log / /tmp/pre_LABEL.log, one line
# printed).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >/dev/null 2>&1
export PYTHONPATH=/tmp/site:.
LANE_TIMEOUT=${LANE_TIMEOUT:-170}
lane() { for f in "$@"; do
  local s=$(date +%s)
  timeout $LANE_TIMEOUT python3 -m pytest -q -m "${LANE_MARK:-gpu}" tests/$f.py -rf --tb=short -p no:cacheprovider \
    > $OUT/$f.log 2>&1
  echo "$f rc=$? $(( $(date +%s)-s ))s: $(tail -1 $OUT/$f.log)"; done; }
ab_decode() {
  local name=$1 label=$2; shift 2
  local dir=$PWD/benchmarks/ab/$name log=/tmp/ab_${name}_$label.log s=$(date +%s)
  (cd "$dir" && PYTHONPATH=/tmp/site timeout 30 python3 -c "import moeserve; print('package', moeserve.__file__)" \
    && PYTHONPATH=/tmp/site timeout ${AB_TIMEOUT:-90} python3 -m moeserve.bench.decode --layers 48 --steps 32 \
    --repeats 1 --out /tmp/ab_out_$name$label "$@") > $log 2>&1
  echo "$name $label rc=$? $(( $(date +%s)-s ))s: $(grep -E '^package|^ +[0-9]+ ' $log | tr -s ' ' | tr '\n' '|')"; }
dec_tiles() {
  local label=$1 tiles=$2 s=$(date +%s); shift 2
  MOESERVE_MOE_TILES=$tiles timeout ${DEC_TIMEOUT:-80} python3 -m moeserve.bench.decode --layers 48 --steps 32 \
    --repeats 1 --quantization fp8 --out /tmp/dec_$label "$@" > /tmp/dec_$label.log 2>&1
  echo "$label rc=$? $(( $(date +%s)-s ))s: $(grep -E '^ +[0-9]+ ' /tmp/dec_$label.log | tr -s ' ' | tr '\n' '|')"; }
pre_tiles() {
  local label=$1 tiles=$2 s=$(date +%s)
  MOESERVE_MOE_TILES=$tiles timeout ${PRE_TIMEOUT:-120} python3 -m moeserve.bench.prefill --layers 48 --repeats 2 \
    --quantization fp8 --out /tmp/pre_$label > /tmp/pre_$label.log 2>&1
  echo "prefill $label rc=$? $(( $(date +%s)-s ))s: $(tail -3 /tmp/pre_$label.log | tr '\n' '|')"; }
