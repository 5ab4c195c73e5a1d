"""Session 24: the expert LoRA's shrink options on the FP8 (W8A8) routed experts, 4 rank-16 adapters, every token
on one (kernels.py's lora4_r16 case), as (MoE + LoRA) / MoE at T = 64, 256, 512. The FP8 path takes its shrink
options from the heuristic (fused_moe_fp8.lora_options) where the bf16 path has tuned rows; in the engine's step
at B = 256 the FP8 gate_up shrink ran 42 us against bf16's 26 (call 1's timeline), on 64-row blocks against 16.

    PYTHONPATH=. python benchmarks/session24/fp8_lora_sweep.py --out DIR
"""
import argparse
import json
import os
import statistics
from dataclasses import replace

import torch

from benchmarks.kernels.kernels import NUM_SETS, lora_args, make_inputs, make_lora_pool, make_weights
from moeserve.bench.common import graph_time_us
from moeserve.kernels.fp8 import quantize_block_fp8
from moeserve.kernels.fused_moe_fp8 import fp8_plan, fused_moe_fp8, lora_options, quantize_w13_fp8
from moeserve.kernels.moe_plan import MoEProblem


def variants(plan):
    v = {"default": plan}
    for warps in (2, 8):
        v[f"w{warps}"] = replace(plan, lora_shrink_warps=warps)
    for lanes in (1, 2, 4, 8):
        v[f"lanes{lanes}"] = replace(plan, lora_shrink_lanes=lanes)
    for bk in (64, 256):
        v[f"k{bk}"] = replace(plan, lora_shrink_block_k=bk)
    for st in (2, 4):
        v[f"st{st}"] = replace(plan, lora_shrink_stages=st)
    for gs, ds in ((2, 1), (4, 2), (2, 2)):
        v[f"splits{gs}/{ds}"] = replace(plan, lora_gate_up_splits=gs, lora_down_splits=ds)
    v["w2_lanes2"] = replace(plan, lora_shrink_warps=2, lora_shrink_lanes=2)
    v["w2_lanes8"] = replace(plan, lora_shrink_warps=2, lora_shrink_lanes=8)
    v["lanes8_k64"] = replace(plan, lora_shrink_lanes=8, lora_shrink_block_k=64)
    return v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="64,256,512")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="fp8_lora_out")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator("cuda").manual_seed(0)
    weights = []
    for _ in range(NUM_SETS):
        w13, w2 = make_weights(gen)
        weights.append((*quantize_w13_fp8(w13), *quantize_block_fp8(w2)))
        del w13, w2
    pools = {16: [make_lora_pool(gen, 16) for _ in range(NUM_SETS)]}
    report = []
    for t in [int(v) for v in args.tokens.split(",")]:
        inputs = [make_inputs(t, gen) for _ in range(NUM_SETS)]
        loras = [lora_args(pools, i, t, "lora4_r16") for i in range(NUM_SETS)]
        problem = MoEProblem(128, 2048, 768, 8, torch.bfloat16, torch.device("cuda"))
        plan = fp8_plan(t, 8, problem, None)
        print(f"T {t}: base plan {plan.gate_up} / {plan.down}; LoRA options {lora_options(t, 8)}", flush=True)

        def timed(lora_plan):
            fns = [lambda w=w, inp=inp, lo=lo: fused_moe_fp8(inp[0], *w, inp[1], inp[2], act_quant=None, pdl=True,
                                                             lora=lo if lora_plan else None, lora_plan=lora_plan)
                   for w, inp, lo in zip(weights, inputs, loras)]
            return graph_time_us(fns)

        cands = variants(lora_options(t, 8))
        times = {name: [] for name in cands}
        base = []
        for _ in range(args.rounds):
            base.append(timed(None))
            for name, lp in cands.items():
                try:
                    times[name].append(timed(lp))
                except Exception as exc:  # a variant that does not compile or launch: reported, not fatal
                    print(f"  {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        b = statistics.median(base)
        for name, ts in times.items():
            if ts:
                us = statistics.median(ts)
                report.append(dict(tokens=t, variant=name, base_us=b, lora_us=us, ratio=us / b))
                print(f"T {t:>4} {name:>14} base {b:7.1f} +LoRA {us:7.1f} x{us / b:.3f}", flush=True)
        json.dump(report, open(os.path.join(args.out, "fp8_lora_sweep.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
