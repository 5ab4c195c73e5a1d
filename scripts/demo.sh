#!/usr/bin/env bash
# Set up, then run the demo on the embedded default model (model and adapters built once into the user cache).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
"${MOESERVE_VENV:-.venv}/bin/python" -m moeserve demo "$@"
