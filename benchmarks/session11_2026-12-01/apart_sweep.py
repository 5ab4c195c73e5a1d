"""The apart LoRA expands (MoEPlan.lora_epilogue=False) at prefill sizes: program warps, rows x columns and items.
Nsight Compute (call 2) found both expand kernels at 12.5 % occupancy (237-255 registers per thread, the act one
spilling) and 20-23 % of DRAM bandwidth: latency-bound. More warps per program halve the registers each thread
holds. Qwen3-30B-A3B expert shapes, 4 rank-16 adapters on every row, bf16, µs per call (CUDA graph, 4 weight sets).

    PYTHONPATH=. python benchmarks/session11_2026-12-01/apart_sweep.py --out DIR
"""
import argparse
import json
import statistics
from dataclasses import replace

import torch

from benchmarks.kernels import kernels as kb
from moeserve.kernels.moe_plan import MoEProblem, default_plan


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="2048,8192")
    args = ap.parse_args()
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
        now = default_plan(t, kb.TOP_K, lora=True, problem=problem)
        apart = replace(now, lora_epilogue=False, lora_gate_up_splits=1, lora_down_splits=1, lora_epilogue_items=4,
                        lora_apart_tile=(64, 128)) if now.lora_epilogue else now
        cands = {"now": now}
        for warps in (4, 8):
            for tile in ((64, 128), (128, 128)):
                for items in (0, 4):
                    cands[f"w{warps}_{tile[0]}x{tile[1]}_i{items}"] = replace(
                        apart, lora_apart_warps=warps, lora_apart_tile=tile, lora_epilogue_items=items)
        times = {}
        for _ in range(2):  # interleaved rounds
            times.setdefault("base", []).append(kb.time_moe(weights, inputs, plan=base_plan, pdl=True))
            for name, plan in cands.items():
                try:
                    times.setdefault(name, []).append(kb.time_moe(weights, inputs, loras, plan=plan, pdl=True))
                except Exception as e:  # registers / shared memory: reported, not fatal
                    times[name] = [float("nan")]
                    print(f"T={t} {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        base = statistics.median(times.pop("base"))
        row = {"tokens": t, "base_us": base, "plans": {}}
        for name, ts in times.items():
            us = statistics.median(ts)
            row["plans"][name] = dict(us=us, ratio=us / base)
        best = min((v["us"], k) for k, v in row["plans"].items() if v["us"] == v["us"])
        errs = kb.lora_errors(weights, inputs, loras[0], cands[best[1]], ref)
        row["best"] = dict(name=best[1], plan=str(cands[best[1]]), **errs)
        print(f"T={t:5d} base {base:7.1f} | now {row['plans']['now']['us']:7.1f} ({row['plans']['now']['ratio']:.2f}x)"
              f" | best {best[1]} {best[0]:7.1f} ({best[0] / base:.2f}x, delta err {errs.get('delta_rel_err'):.1e})",
              flush=True)
        print("   " + " ".join(f"{k}={v['us']:.0f}" for k, v in row["plans"].items()), flush=True)
        rows.append(row)
    with open(f"{args.out}/apart_sweep.json", "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
