"""FP8 routed experts (W8A8 on the sorted path, what the engine runs) with 4 rank-16 adapters on every row, the
in-place LoRA walk in the FP8 GEMMs' epilogues, against the FP8 call without LoRA, in rank-16 and rank-64 pools.
Qwen3-30B-A3B expert shapes, µs per call (CUDA graph over 4 weight sets, interleaved rounds, medians).

    PYTHONPATH=. python benchmarks/session17/fp8_walk.py --out DIR [--batches 16,64,...]
"""
import argparse
import json
import statistics

import torch

from benchmarks.kernels import fp8_moe as fb
from benchmarks.kernels import kernels as kb
from moeserve.bench.common import graph_time_us
from moeserve.kernels.fused_moe_fp8 import fused_moe_fp8


def fp8_calls(weights, inputs, loras=None):
    return [lambda w=w, i=i, lora=(loras[n] if loras else None):
            fused_moe_fp8(i[0], *w[2:], i[1], i[2], act_quant=None, pdl=True, lora=lora)
            for n, (w, i) in enumerate(zip(weights, inputs))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="16,64,256,512,1024,2048,4096")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    weights = [fb.make_weights(gen) for _ in range(kb.NUM_SETS)]
    pools = {r: [kb.make_lora_pool(gen, r) for _ in range(kb.NUM_SETS)] for r in (16, 64)}
    rows = []
    for t in map(int, args.batches.split(",")):
        inputs = [fb.make_inputs(t, gen) for _ in range(kb.NUM_SETS)]
        loras = {r: [kb.lora_args(p[i], t, "lora4_r16") for i in range(kb.NUM_SETS)] for r, p in pools.items()}
        times: dict = {}
        for _ in range(args.rounds):
            times.setdefault("base", []).append(graph_time_us(fp8_calls(weights, inputs)))
            for r, lo in loras.items():
                times.setdefault(f"R{r}", []).append(graph_time_us(fp8_calls(weights, inputs, lo)))
        us = {k: statistics.median(v) for k, v in times.items()}
        rows.append(dict(tokens=t, us=us, ratio={k: v / us["base"] for k, v in us.items()}))
        print(f"FP8 T={t:5d} base {us['base']:7.1f} | " + "  ".join(
            f"{k}={v:.0f} ({v / us['base']:.3f})" for k, v in us.items() if k != "base"), flush=True)
    with open(f"{args.out}/fp8_walk.json", "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
