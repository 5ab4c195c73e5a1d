# Sourced by the device-call scripts (run with `carry: [".whl"]`; benchmarks/device_wheels.sh fills .whl/ with the
# wheels the device lacks, at .venv's versions): those wheels installed beside
# the tree, the tree on the path, and `lane FILE...` (GPU-marked tests of tests/FILE.py one after another, each
# under LANE_TIMEOUT seconds, its log in $OUT/FILE.log and one summary line printed).
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
