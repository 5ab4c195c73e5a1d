#!/usr/bin/env bash
# #26 on the nvidia-h200-x2 kind (carry .whl), when `status` lists it: the two-GPU tests, TP / EP decode, the
# all-reduce choice, and data parallelism through the server against one GPU. Each step under its own limit.
source benchmarks/device_env.sh
t0=$(date +%s)
LANE_MARK=gpu_multi LANE_TIMEOUT=200 lane test_tensor_parallel test_layer_profile
grep -h -A8 "^FAILED\|^ERROR" $OUT/test_*.log | head -30 | cut -c1-300
timeout 60 python3 -m benchmarks.kernels.collectives --world-size 2 --out $OUT/collectives 2>&1 | tail -12
timeout 240 python3 -m moeserve.bench.tp_decode --layers 48 --settings tp1,tp2,ep2 --batches 1,64,256,512 \
  --modes base,idle-dual,active --steps 32 --repeats 2 --out $OUT/tp 2>&1 | grep -v Warn | tail -20
echo "== tp done at $(( $(date +%s)-t0 )) s"
# next call: data parallelism, one GPU against two, 512 clients (docs/benchmarks.md, "Serving")
# for dp in 1 2; do timeout 280 python3 -m moeserve.bench.protocol --parts base --concurrency 512 --num-prompts 1024 \
#   --server-args "--data-parallel-size $dp" --out $OUT/dp$dp 2>&1 | grep -E "server up|run |base" | tail -6; done
