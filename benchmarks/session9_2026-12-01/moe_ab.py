"""Fused MoE with its default plan, and its alignment alone, at Qwen3-30B-A3B expert shapes (E 128, H 2048,
I 768, top-8, bf16), µs per call in a CUDA graph over 4 weight sets (cold L2). Runs against whichever moeserve is
on the path, so the same script times two trees in turn (A, B, A, B):

    PYTHONPATH=<tree> python benchmarks/session9_2026-12-01/moe_ab.py --tag new --out DIR
"""
import argparse
import json
import statistics

import torch

import moeserve.kernels.fused_moe as fm
from moeserve.bench.common import graph_time_us
from moeserve.kernels.moe_align import moe_align

E, H, I, K = 128, 2048, 768, 8
BATCHES = (1, 8, 64, 256, 512, 1024, 2048, 4096, 8192)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    args = ap.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    weights = [((torch.randn(E, 2 * I, H, generator=gen, device="cuda") * 0.02).bfloat16(),
                (torch.randn(E, H, I, generator=gen, device="cuda") * 0.02).bfloat16()) for _ in range(4)]
    rows = []
    for t in map(int, args.batches.split(",")):
        inputs = []
        for _ in weights:
            x = torch.randn(t, H, generator=gen, device="cuda").bfloat16()
            w, ids = torch.softmax(torch.randn(t, E, generator=gen, device="cuda"), -1).topk(K, -1)
            inputs.append((x, w, ids.to(torch.int32)))
        fns = [lambda wt=wt, inp=inp: fm.fused_moe(inp[0], wt[0], wt[1], inp[1], inp[2], pdl=True)
               for wt, inp in zip(weights, inputs)]
        moe = statistics.median(graph_time_us(fns) for _ in range(3))
        plan = fm.default_plan(t, K) if not hasattr(fm, "MoEProblem") else fm.default_plan(
            t, K, problem=fm.MoEProblem(E, H, I, K, torch.bfloat16, torch.device("cuda")))
        align = None
        if not plan.decode:
            align = statistics.median(graph_time_us(
                [lambda ids=inp[2]: moe_align(ids, E, plan.gate_up.block_m, pdl=True) for inp in inputs])
                for _ in range(3))
        floor_us = E * (1 - (1 - K / E) ** t) * 3 * H * I * 2 / 4.3e12 * 1e6
        rows.append({"tokens": t, "moe_us": moe, "align_us": align, "floor_us": floor_us,
                     "block_m": plan.gate_up.block_m})
        print(f"{args.tag} T={t:5d} moe {moe:8.1f} us  align {align if align else float('nan'):7.1f} us  "
              f"floor {floor_us:6.1f}", flush=True)
    with open(f"{args.out}/moe_ab_{args.tag}.json", "w") as f:
        json.dump({"tag": args.tag, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
