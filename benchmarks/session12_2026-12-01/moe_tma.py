"""Routed-expert GEMMs with their weight tiles read through TMA descriptors (MoEPlan.weights_tma) against pointer
loads, on the tuned tiles and a few variants TMA's lighter register use may allow; without and with 4 rank-16
adapters on every row (the LoRA path above the apart threshold runs the same GEMMs). Qwen3-30B-A3B expert shapes,
bf16, µs per call (CUDA graph over 4 weight sets, interleaved rounds, medians).

    PYTHONPATH=. python benchmarks/session12_2026-12-01/moe_tma.py --out DIR [--batches 256,...] [--lora-batches ...]
"""
import argparse
import json
import statistics
from dataclasses import replace

import torch

from benchmarks.kernels import kernels as kb
from moeserve.kernels.fused_moe import fused_moe
from moeserve.kernels.moe_plan import MoEProblem, default_plan, fit_plan


def variants(plan, extra: bool):
    gu, dn = plan.gate_up, plan.down
    out = {"pointers": replace(plan, weights_tma=False), "tma": replace(plan, weights_tma=True)}
    if extra and gu.block_m >= 64:
        out["tma_g8"] = replace(plan, weights_tma=True, gate_up=replace(gu, group_m=8), down=replace(dn, group_m=8))
        out["tma_k128s2"] = replace(plan, weights_tma=True, gate_up=replace(gu, block_k=128, num_stages=2),
                                    down=replace(dn, block_k=128, num_stages=2))
        out["tma_n128s5"] = replace(plan, weights_tma=True, gate_up=replace(gu, block_n=128, num_stages=5),
                                    down=replace(dn, block_n=128, num_stages=5))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="16,64,256,512,1024,2048,4096,8192")
    ap.add_argument("--lora-batches", default="2048,8192")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only-tma", action="store_true", help="pointers and TMA on the table's tiles, no tile variants")
    args = ap.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    weights = [kb.make_weights(gen) for _ in range(kb.NUM_SETS)]
    pools = [kb.make_lora_pool(gen) for _ in range(kb.NUM_SETS)]
    problem = MoEProblem(kb.NUM_EXPERTS, kb.HIDDEN, kb.INTER, kb.TOP_K, torch.bfloat16, torch.device("cuda"))
    rows = []
    lora_batches = {int(t) for t in args.lora_batches.split(",") if t}
    for t in map(int, args.batches.split(",")):
        inputs = [kb.make_inputs(t, gen) for _ in range(kb.NUM_SETS)]
        cases = [("base", None, default_plan(t, kb.TOP_K, problem=problem))]
        if t in lora_batches:
            cases.append(("lora", [kb.lora_args(pools[i], t, "lora4_r16") for i in range(kb.NUM_SETS)],
                          default_plan(t, kb.TOP_K, lora=True, problem=problem)))
        for case, loras, plan in cases:
            cands = {k: fit_plan(v, torch.bfloat16, problem.device)
                     for k, v in variants(plan, not args.only_tma).items()}
            (w13, w2), (x, tw, ti) = weights[0], inputs[0]
            ref = fused_moe(x, w13, w2, tw, ti, loras[0] if loras else None, plan=plan, pdl=True)
            times, exact = {}, {}
            for _ in range(args.rounds):
                for name, p in cands.items():
                    try:
                        times.setdefault(name, []).append(kb.time_moe(weights, inputs, loras, plan=p, pdl=True))
                    except Exception as e:  # shared memory / registers: reported, not fatal
                        times[name] = [float("nan")]
                        print(f"T={t} {case} {name}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            for name, p in cands.items():
                if times[name][0] == times[name][0]:
                    out = fused_moe(x, w13, w2, tw, ti, loras[0] if loras else None, plan=p, pdl=True)
                    exact[name] = bool(torch.equal(out, ref))
            med = {k: statistics.median(v) for k, v in times.items()}
            base = med["pointers"]
            row = dict(tokens=t, case=case, us=med, bitwise_pointers=exact,
                       plans={k: str(v) for k, v in cands.items()})
            rows.append(row)
            print(f"T={t:5d} {case:4s} " + "  ".join(
                f"{k}={v:7.1f} ({v / base:.3f}{'' if exact.get(k, True) else ' !='})" for k, v in med.items()),
                flush=True)
    with open(f"{args.out}/moe_tma.json", "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
