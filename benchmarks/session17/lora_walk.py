"""Routed experts with 4 rank-16 adapters on every row, the in-place LoRA epilogue one slot a dot (the engine's plan,
lora_epilogue_items 1) against the same walk with the next slot's operands loaded before the current dot (items 0,
lora_block_expand in place), in a pool of max rank 16 (the engine's default) and 64. Qwen3-30B-A3B expert shapes,
bf16, µs per call (CUDA graph over 4 weight sets, interleaved rounds, medians), the LoRA delta's error against the
fp32 reference.

    PYTHONPATH=. python benchmarks/session17/lora_walk.py --out DIR [--batches 64,256,...] [--ranks 16,64]
"""
import argparse
import json
import statistics
from dataclasses import replace

import torch

from benchmarks.kernels import kernels as kb
from moeserve.kernels.moe_plan import MoEProblem, default_plan, fit_plan


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="64,256,512,1024,2048,4096,8192")
    ap.add_argument("--ranks", default="16,64", help="max ranks of the pools")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    weights = [kb.make_weights(gen) for _ in range(kb.NUM_SETS)]
    problem = MoEProblem(kb.NUM_EXPERTS, kb.HIDDEN, kb.INTER, kb.TOP_K, torch.bfloat16, torch.device("cuda"))
    ranks = [int(r) for r in args.ranks.split(",")]
    pools = {r: [kb.make_lora_pool(gen, r) for _ in range(kb.NUM_SETS)] for r in ranks}
    rows = []
    for t in map(int, args.batches.split(",")):
        inputs = [kb.make_inputs(t, gen) for _ in range(kb.NUM_SETS)]
        base_plan = default_plan(t, kb.TOP_K, problem=problem)
        engine = default_plan(t, kb.TOP_K, lora=True, problem=problem)
        cands = {"items1": engine, "walk": fit_plan(replace(engine, lora_epilogue_items=0), torch.bfloat16,
                                                     problem.device)}
        loras = {r: [kb.lora_args(pools[r][i], t, "lora4_r16") for i in range(kb.NUM_SETS)] for r in ranks}
        times: dict = {}
        for _ in range(args.rounds):
            times.setdefault("base", []).append(kb.time_moe(weights, inputs, plan=base_plan, pdl=True))
            for r in ranks:
                for name, plan in cands.items():
                    times.setdefault(f"R{r}:{name}", []).append(
                        kb.time_moe(weights, inputs, loras[r], plan=plan, pdl=True))
        base = statistics.median(times.pop("base"))
        us = {k: statistics.median(v) for k, v in times.items()}
        ref = kb.lora_reference(weights, inputs, loras[ranks[0]][0], tokens=32)
        errs = {name: kb.lora_errors(weights, inputs, loras[ranks[0]][0], plan, ref).get("delta_rel_err")
                for name, plan in cands.items()}
        rows.append(dict(tokens=t, base_us=base, us=us, ratio={k: v / base for k, v in us.items()}, delta_err=errs))
        print(f"T={t:5d} base {base:7.1f} | " + "  ".join(f"{k}={v:.0f} ({v / base:.3f})" for k, v in us.items())
              + "  | err " + " ".join(f"{k}={v:.1e}" for k, v in errs.items()), flush=True)
    with open(f"{args.out}/lora_walk.json", "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
