"""Fused MoE with four rank-16 adapters (every row on one): the LoRA plan today (heuristic tiles) against LoRA on
the tuned table's tiles with the expands apart from the GEMMs (MoEPlan.lora_epilogue=False), beside the MoE alone on its tuned plan. Qwen3-30B-A3B expert shapes, bf16, µs per call in
a CUDA graph over 4 weight sets; error of the LoRA delta against the fp32 reference for each candidate.

    PYTHONPATH=. python benchmarks/session10_2026-12-01/moe_lora_tiles.py --out DIR
"""
import argparse
import json
import statistics
from dataclasses import replace

import torch

from benchmarks.kernels import kernels as kb  # moeserve.bench.kernels in calls 3-6
from moeserve.kernels.moe_plan import MoEProblem, default_plan


VARIANTS = "splits"  # --variants


def candidates(t: int, problem) -> dict:
    base = default_plan(t, kb.TOP_K, problem=problem)
    lora = default_plan(t, kb.TOP_K, lora=True, problem=problem)
    out = {"lora_now": lora}
    if base.decode:
        return out
    apart = replace(base, lora_epilogue=False, lora_epilogue_items=4)  # the tuned no-LoRA tiles, expands after
    if VARIANTS == "tiles":  # call 7: the expand programs' shape (rows x columns) and the walk vs 4 items
        for rows, cols in ((64, 128), (64, 64), (32, 64), (16, 64), (128, 32)):
            out[f"apart_{rows}x{cols}"] = replace(apart, lora_gate_up_splits=1, lora_down_splits=1,
                                                  lora_apart_tile=(rows, cols))
        out["apart_64x64_walk"] = replace(out["apart_64x64"], lora_epilogue_items=0)
        return out
    out["apart_64x128"] = apart
    out["apart_64x128_split1"] = replace(apart, lora_gate_up_splits=1, lora_down_splits=1)
    out["apart_32x256_split1"] = replace(apart, lora_gate_up_splits=1, lora_down_splits=1, lora_apart_tile=(32, 256))
    out["apart_16x256_split1"] = replace(apart, lora_gate_up_splits=1, lora_down_splits=1, lora_apart_tile=(16, 256))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="64,256,512,2048,8192")
    ap.add_argument("--variants", default="splits", choices=("splits", "tiles"))
    args = ap.parse_args()
    global VARIANTS
    VARIANTS = args.variants
    gen = torch.Generator("cuda").manual_seed(0)
    weights = [kb.make_weights(gen) for _ in range(kb.NUM_SETS)]
    pools = [kb.make_lora_pool(gen) for _ in range(kb.NUM_SETS)]
    problem = MoEProblem(kb.NUM_EXPERTS, kb.HIDDEN, kb.INTER, kb.TOP_K, torch.bfloat16, torch.device("cuda"))
    rows = []
    for t in map(int, args.batches.split(",")):
        inputs = [kb.make_inputs(t, gen) for _ in range(kb.NUM_SETS)]
        loras = [kb.lora_args(pools[i], t, "lora4_r16") for i in range(kb.NUM_SETS)]
        ref = kb.lora_reference(weights, inputs, loras[0], tokens=32)
        base_plan = default_plan(t, kb.TOP_K, problem=problem)
        row = {"tokens": t, "base_us": None, "plans": {}}
        times = {}
        cands = candidates(t, problem)
        for _ in range(2):  # interleaved rounds
            times.setdefault("base", []).append(kb.time_moe(weights, inputs, plan=base_plan, pdl=True))
            for name, plan in cands.items():
                try:
                    times.setdefault(name, []).append(kb.time_moe(weights, inputs, loras, plan=plan, pdl=True))
                except Exception as e:  # a candidate that does not compile (registers, smem) is reported, not fatal
                    times[name] = [float("nan")]
                    row["plans"][name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        row["base_us"] = statistics.median(times.pop("base"))
        line = f"T={t:5d} base {row['base_us']:7.1f}"
        for name, ts in times.items():
            us = statistics.median(ts)
            entry = row["plans"].setdefault(name, {})
            entry.update(us=us, ratio=us / row["base_us"], plan=str(cands[name]))
            if "error" not in entry:
                entry.update(kb.lora_errors(weights, inputs, loras[0], cands[name], ref))
            line += f" | {name} {us:7.1f} ({us / row['base_us']:.2f}x, d-err {entry.get('delta_rel_err', float('nan')):.1e})"
        print(line, flush=True)
        rows.append(row)
    with open(f"{args.out}/moe_lora_tiles.json", "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
