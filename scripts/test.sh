#!/usr/bin/env bash
# Set up, then run the test suite on CPU with the venv's Python (GPU-marked tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two pytest-xdist workers, one a core: most tests run one thread at a time (the Triton interpreter, process
# start-ups, servers waiting on requests). A module whose tests share a module-scoped fixture stays on one worker,
# as do the demo model's tests; other tests spread one by one; the longest units go first (tests/conftest.py,
# group_for_workers), in that order (no reordering by test count).
# Then the tests marked serial (latency bounds under a flood) alone, as a second worker would slow their server;
# only the files that mark one are collected for it (the whole suite's collection took ~12 s, one core idle).
export TRITON_INTERPRET=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# pytest keeps the modules it rewrites for assertions (its plugins' too: ~330 of them, ~5 s of a core in each pytest
# process) only where Python may write bytecode
unset PYTHONDONTWRITEBYTECODE
pytest=("${MOESERVE_VENV:-.venv}/bin/python" -m pytest -q -p no:cacheprovider --durations=15)
status=0
run() { "${pytest[@]}" "$@" || { rc=$?; [ "$rc" -eq 5 ] || status=$rc; }; }  # 5: "$@" selected none of these
run -n "${MOESERVE_TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder -m "not serial" tests "$@"
mapfile -t serial_files < <(grep -l "mark\.serial" tests/test_*.py)
[ "${#serial_files[@]}" -eq 0 ] || run -m serial "${serial_files[@]}" "$@"
exit "$status"
