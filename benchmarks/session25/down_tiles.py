"""Session 25 (prepared for the next device call): the W8A8 down GEMM's own tile, the gate_up's kept as shipped.

At B = 256 the FP8 step's down GEMM runs 3.44 TB/s where the gate_up runs 3.9 (session 24's timeline): its K walk
is 768 columns, 6 steps of 128, so each program's pipeline fills and drains for few steps, and the tile table's
sweep (benchmarks/kernels/fp8_moe.py --sweep) gave both GEMMs one tile. Here the down tile alone varies: wider
column tiles (more bytes a program keeps in flight), more stages, 8 warps, grouped block order; block_m stays
the alignment's. Routed experts at Qwen3-30B-A3B shapes, W8A8, µs per call in a CUDA graph over 4 weight sets,
medians of interleaved rounds, without and with 4 rank-16 adapters on every token. Writes DIR/down_tiles.json and
DIR/moe_tiles_down.json: the shipped table with the W8A8 rows of the T that a candidate won by 1 % (without LoRA,
and not losing 1 % with it) given that down tile, for `MOESERVE_MOE_TILES=...` A/Bs of bench decode and prefill.

    PYTHONPATH=. python benchmarks/session25/down_tiles.py --out DIR [--tokens 256,512,128,1024]
"""
import argparse
import json
import os
from dataclasses import replace

import torch

from benchmarks.kernels import fp8_moe
from moeserve.kernels.fused_moe_fp8 import fp8_plan

# (block_n, num_warps, num_stages, group_m) of the down tile; block_k stays 128 (one scale group a K step)
DOWN_CANDIDATES = [(128, 4, 4, None), (128, 4, 5, None), (128, 8, 3, None), (128, 8, 4, None), (256, 8, 3, None),
                   (256, 8, 4, None), (64, 4, 4, None), (64, 4, 5, None), (128, 4, 3, 1), (128, 4, 3, 8)]


def candidates(shipped):
    """The shipped plan and the down-tile variants of it (the shipped down tile itself left out)."""
    v = {"shipped": shipped}
    for bn, warps, stages, group_m in DOWN_CANDIDATES:
        tile = replace(shipped.down, block_n=bn, num_warps=warps, num_stages=stages,
                       group_m=shipped.down.group_m if group_m is None else group_m)
        if tile != shipped.down:
            v[f"down_n{bn}w{warps}s{stages}g{tile.group_m}"] = replace(shipped, down=tile)
    return v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="256,512,128,1024")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="down_out")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator("cuda").manual_seed(0)
    weights, pools, problem = fp8_moe.w8a8_sweep_sets(gen)
    report, best = [], {}
    for t in [int(v) for v in args.tokens.split(",")]:
        inputs, loras = fp8_moe.w8a8_sweep_inputs(t, gen, pools)
        cands = candidates(fp8_plan(t, 8, problem, True))
        times = fp8_moe.time_plans(cands, weights, inputs, loras, args.rounds)
        base, base_lora = times["shipped", False], times["shipped", True]
        for name, plan in cands.items():
            us, us_lora = times[name, False], times[name, True]
            if isinstance(us, str) or isinstance(us_lora, str):  # did not compile or launch
                print(f"  T {t} {name}: {us if isinstance(us, str) else us_lora}", flush=True)
                continue
            report.append(dict(tokens=t, variant=name, down=plan.down.as_list(), us=us, lora_us=us_lora,
                               vs_shipped=us / base, lora_vs_shipped=us_lora / base_lora))
            print(f"T {t:>5} {name:>22} {us:8.1f} us ({us / base:.3f}x)  with LoRA {us_lora:8.1f} us "
                  f"({us_lora / base_lora:.3f}x)", flush=True)
        won = [r for r in report if r["tokens"] == t and r["variant"] != "shipped"
               and r["vs_shipped"] < 0.99 and r["lora_vs_shipped"] < 1.01]
        if won:
            best[t] = cands[min(won, key=lambda r: r["us"])["variant"]]
        json.dump(report, open(os.path.join(args.out, "down_tiles.json"), "w"), indent=1)
        fp8_moe.table_with_w8a8_rows(best, ("down",), os.path.join(args.out, "moe_tiles_down.json"))
    print("table rows:", sorted(best))


if __name__ == "__main__":
    main()
