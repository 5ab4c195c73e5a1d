#!/usr/bin/env bash
# Set up, then run the test suite on CPU with the venv's Python (GPU-marked tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TRITON_INTERPRET=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
"${MOESERVE_VENV:-.venv}/bin/python" -m pytest -q -p no:cacheprovider --durations=15 tests "$@"
