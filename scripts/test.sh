#!/usr/bin/env bash
# Set up, then run the test suite on CPU with the venv's Python (GPU-marked tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two pytest-xdist workers, one a core: most tests run one thread at a time (the Triton interpreter, process
# start-ups, servers waiting on requests). Each module's tests stay on one worker and the demo model's tests go
# first on theirs (tests/conftest.py), in collection order (no reordering by test count).
export TRITON_INTERPRET=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
"${MOESERVE_VENV:-.venv}/bin/python" -m pytest -q -p no:cacheprovider --durations=15 \
  -n "${MOESERVE_TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder tests "$@"
