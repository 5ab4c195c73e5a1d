"""Session 26 (prepared for the next device call; run from inside branch s26-act-sorted's package): the W8A8 expert
GEMMs with their activations in the alignment's order through TMA (act_sorted), and with the K loop
warp-specialized (warp_specialize), against the shipped plan, at prefill sizes.

The shipped W8A8 GEMM waits for each K step's QGMMA before scaling it (the block scales), so at T = 8,192 it runs
36 % of the FP8 peak. A warp-specialized loop (Triton: a producer warp group issues the TMA loads, consumer groups
multiply and scale) needs both operands through TMA, so the activations are first copied into the alignment's order
(fp8_gather_rows: one more launch, rows x H bytes). Routed experts at Qwen3-30B-A3B shapes, µs per call in a CUDA
graph over 4 weight sets, medians of interleaved rounds, without and with 4 rank-16 adapters (a LoRA call keeps
the pair order: its column shows the plain path under that plan, a control). Also checks each variant's output
bitwise against the shipped plan's. Writes DIR/ws_tiles.json and DIR/moe_tiles_ws.json (the shipped table with the
W8A8 rows of the T that a variant won by 3 %, for `MOESERVE_MOE_TILES=...` in bench prefill).

    cd benchmarks/ab/<branch> && PYTHONPATH=$PWD:<root> python <root>/benchmarks/session26/ws_tiles.py --out DIR
"""
import argparse
import json
import os
from dataclasses import replace

import torch

from benchmarks.kernels import fp8_moe
from moeserve.kernels.fused_moe_fp8 import fp8_plan, fused_moe_fp8
from moeserve.kernels.moe_plan import GemmTile, fit_tile, smem_limit


def candidates(shipped, device):
    """The shipped plan, it with act_sorted (with and without warp specialization), and the 128 x 128 tile with 4
    warps (two consumer warp groups of 64 rows under warp specialization; it spills without) the same ways."""
    v = {"shipped": shipped}
    v["sorted"] = replace(shipped, act_sorted=True)
    v["sorted_ws"] = replace(shipped, act_sorted=True, warp_specialize=True)
    limit = smem_limit(device)
    for bm, bn, warps, stages in ((128, 128, 4, 3), (128, 128, 4, 4), (64, 128, 4, 4), (128, 256, 4, 3)):
        tile = fit_tile(GemmTile(bm, bn, 128, warps, stages, 1), 1, 1, limit)
        v[f"ws_{bm}x{bn}w{warps}s{stages}"] = replace(shipped, gate_up=tile, down=tile, weights_tma=True,
                                                      act_sorted=True, warp_specialize=True)
    return v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8192,2048,4096,1024")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="ws_out")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator("cuda").manual_seed(0)
    weights, pools, problem = fp8_moe.w8a8_sweep_sets(gen)
    report, best = [], {}
    for t in [int(v) for v in args.tokens.split(",")]:
        inputs, loras = fp8_moe.w8a8_sweep_inputs(t, gen, pools)
        cands = candidates(fp8_plan(t, 8, problem, True), problem.device)
        w, inp = weights[0], inputs[0]
        ref = fused_moe_fp8(inp[0], *w, inp[1], inp[2], act_quant=True, plan=cands["shipped"], pdl=True)
        same = {}
        for name, plan in cands.items():
            try:
                out = fused_moe_fp8(inp[0], *w, inp[1], inp[2], act_quant=True, plan=plan, pdl=True)
                same[name] = bool(torch.equal(out, ref))
            except Exception as e:  # noqa: BLE001 (a variant that does not compile is a result too)
                same[name] = f"{type(e).__name__}: {str(e)[:200]}"
        times = fp8_moe.time_plans(cands, weights, inputs, loras, args.rounds)
        base, base_lora = times["shipped", False], times["shipped", True]
        flop = 2 * t * 8 * 3 * 2048 * 768
        for name, plan in cands.items():
            us, us_lora = times[name, False], times[name, True]
            if isinstance(us, str):
                print(f"  T {t} {name}: {us}", flush=True)
                continue
            report.append(dict(tokens=t, variant=name, gate_up=plan.gate_up.as_list(), us=us, lora_us=us_lora,
                               vs_shipped=us / base, same_bits=same[name], tflops=flop / us / 1e6))
            print(f"T {t:>5} {name:>18} {us:8.1f} us ({us / base:.3f}x, {flop / us / 1e6:5.0f} TFLOP/s) with LoRA "
                  f"{us_lora if isinstance(us_lora, str) else f'{us_lora:8.1f}'} same bits {same[name]}", flush=True)
        won = [r for r in report if r["tokens"] == t and r["variant"] != "shipped" and r["vs_shipped"] < 0.97
               and r["same_bits"] is True]
        if won:
            best[t] = cands[min(won, key=lambda r: r["us"])["variant"]]
        json.dump(report, open(os.path.join(args.out, "ws_tiles.json"), "w"), indent=1)
    fp8_moe.table_with_w8a8_rows(best, ("gate_up", "down"), os.path.join(args.out, "moe_tiles_ws.json"),
                                 ("weights_tma", "act_sorted", "warp_specialize"))
    print("table rows:", sorted(best))


if __name__ == "__main__":
    main()
