"""Routed experts with 4 rank-16 adapters on every row: does the in-place LoRA epilogue cost what it does because
one CTA holds an SM alone while its epilogue walks the block's slots (one dependent load and dot per slot, nothing
else resident to hide them)? The engine's tiles with fewer pipeline stages (less shared memory per CTA, so two or
three CTAs per SM) for the gate_up and the down GEMM, each timed without LoRA and with it. Stages change neither
the tiles nor the accumulation order, so a LoRA call may run other stages than the no-LoRA call and keep its rows
without an adapter bitwise. Qwen3-30B-A3B expert shapes, bf16, µs per call (CUDA graph over 4 weight sets,
interleaved rounds, medians).

    PYTHONPATH=. python benchmarks/session17/lora_occupancy.py --out DIR [--batches 64,256,512,1024]
"""
import argparse
import json
import statistics
from dataclasses import replace

import torch

from benchmarks.kernels import kernels as kb
from moeserve.kernels.moe_plan import MoEProblem, default_plan, fit_plan


def variants(plan) -> dict:
    gs, ds = plan.gate_up.num_stages, plan.down.num_stages
    out = {}
    for dg, dd in ((0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)):
        if gs - dg >= 2 and ds - dd >= 2:
            out[f"gu_s{gs - dg}_dn_s{ds - dd}"] = replace(
                plan, gate_up=replace(plan.gate_up, num_stages=gs - dg), down=replace(plan.down, num_stages=ds - dd))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="64,256,512,1024")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    weights = [kb.make_weights(gen) for _ in range(kb.NUM_SETS)]
    pools = [kb.make_lora_pool(gen) for _ in range(kb.NUM_SETS)]
    problem = MoEProblem(kb.NUM_EXPERTS, kb.HIDDEN, kb.INTER, kb.TOP_K, torch.bfloat16, torch.device("cuda"))
    rows = []
    for t in map(int, args.batches.split(",")):
        inputs = [kb.make_inputs(t, gen) for _ in range(kb.NUM_SETS)]
        loras = [kb.lora_args(pools[i], t, "lora4_r16") for i in range(kb.NUM_SETS)]
        base_v = variants(default_plan(t, kb.TOP_K, problem=problem))
        lora_v = variants(default_plan(t, kb.TOP_K, lora=True, problem=problem))
        times: dict = {}
        for _ in range(args.rounds):
            for name in base_v:
                for kind, plan, lo in (("base", base_v[name], None), ("lora", lora_v[name], loras)):
                    key = f"{kind}:{name}"
                    if times.get(key) == [float("nan")]:
                        continue
                    try:
                        us = kb.time_moe(weights, inputs, lo, plan=fit_plan(plan, torch.bfloat16, problem.device),
                                         pdl=True)
                        times.setdefault(key, []).append(us)
                    except Exception as e:  # shared memory / registers: reported, not fatal
                        times[key] = [float("nan")]
                        print(f"T={t} {key}: {type(e).__name__}: {str(e)[:160]}", flush=True)
        us = {k: statistics.median(v) for k, v in times.items()}
        ref = us[f"base:{next(iter(base_v))}"]
        rows.append(dict(tokens=t, us=us, engine_base=ref, plans={k: str(v) for k, v in lora_v.items()}))
        print(f"T={t:5d} (÷ the engine's no-LoRA call {ref:.1f} us)", flush=True)
        for name in base_v:
            b, lo = us.get(f"base:{name}", float("nan")), us.get(f"lora:{name}", float("nan"))
            print(f"   {name:16s} base {b:7.1f} ({b / ref:.3f})  lora {lo:7.1f} ({lo / ref:.3f})", flush=True)
    with open(f"{args.out}/lora_occupancy.json", "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
