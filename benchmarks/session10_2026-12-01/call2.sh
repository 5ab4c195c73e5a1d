#!/usr/bin/env bash
# #21 item 2: a fresh server's first adapter traffic (512 requests, 256 clients; adapters preloaded from
# --lora-modules, warm-up at start), then the same protocol again in a new server process: the second start
# finds Triton's on-disk cache, which the start-up time shows.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site
for run in 1 2; do
  echo "== start $run"
  timeout 280 python3 -m moeserve.bench.protocol --parts cold --out $OUT/protocol$run 2>&1 | grep -E "server up|tok/s|cold|run |failed|Error" | tail -14
done
