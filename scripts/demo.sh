#!/usr/bin/env bash
# Set up, then run the demo on the embedded default model (built once into the user cache).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m moeserve.cli demo "$@"
