"""Session 24 (prepared for the next device call): two W8A8 expert-GEMM options against the shipped plan at
T = 16 ... 8,192, with and without 4 rank-16 adapters on every token:
- SiLU*up and h's quantization in the gate_up GEMM's epilogue (MoEPlan.act_in_gate_up) instead of gu and a
  separate silu_mul_quant_fp8 launch; the gate_up tile as shipped (128 columns a program: one scale group) with
  its warps and stages varied (64-row blocks need 8 warps for the two accumulators: 4 spill,
  benchmarks/kernels/sass.py --act-out);
- the down GEMM on 16-row parts of the alignment's 64-row blocks (the W8A8 down GEMM ran 3.76 TB/s at T = 64 on
  16-row blocks, 3.34 at 256 on 64-row ones; its LoRA epilogue walks fewer slots a program).
Also writes DIR/moe_tiles_act.json: the shipped FP8 W8A8 rows with the fastest candidate per T where it won by 1 %
(others as shipped), for `MOESERVE_MOE_TILES=DIR/moe_tiles_act.json` A/Bs of bench decode and bench prefill.

    PYTHONPATH=. python benchmarks/session24/act_in_gate_up.py --out DIR

Ran in session 25 (call 1, on 58bc7a3): both options lost at every T and were taken out (aedebc2), so this script
no longer runs against later trees; it stays as the record of what was timed (BENCHMARKS.md, session 25).
"""
import argparse
import json
import os
from dataclasses import replace

import torch

from benchmarks.kernels import fp8_moe
from benchmarks.kernels.kernels import NUM_SETS, lora_args, make_inputs, make_lora_pool
from moeserve.kernels.fused_moe_fp8 import fp8_plan, fused_moe_fp8
from moeserve.kernels.moe_plan import TABLE_PATH, MoEProblem


def candidates(shipped):
    """The shipped plan; the activation in the gate_up epilogue on the shipped tile with 4 / 8 warps and 2-4
    stages; where the alignment's blocks are taller than 16 rows, the down GEMM on their 16-row parts (its other
    tile sizes as shipped), alone and with the 8-warp, 3-stage activation candidate."""
    gu, dn = shipped.gate_up, shipped.down
    v = {"shipped": shipped}
    for warps in (4, 8):
        for stages in (2, 3, 4):
            tile = replace(gu, block_n=128, num_warps=warps, num_stages=stages)
            v[f"act_w{warps}s{stages}"] = replace(shipped, gate_up=tile, act_in_gate_up=True)
    if dn.block_m > 16:
        v["down16"] = replace(shipped, down=replace(dn, block_m=16))
        v["act_w8s3+down16"] = replace(v["act_w8s3"], down=replace(dn, block_m=16))
    return v


def write_table(best: dict, path: str) -> None:
    """The shipped table with the W8A8 rows of the token counts in `best` replaced by those plans' tiles and option
    (every row written after each T, so a sweep cut short leaves a table of what it measured)."""
    table = json.loads(TABLE_PATH.read_text())
    for entry in table["entries"]:
        if entry["dtype"] != "fp8_w8a8":
            continue
        for row in entry["tiles"]:
            plan = best.get(row["max_tokens"])
            if plan is not None:
                row["gate_up"], row["down"] = plan.gate_up.as_list(), plan.down.as_list()
                row["act_in_gate_up"] = plan.act_in_gate_up
    json.dump(table, open(path, "w"), indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="16,64,128,256,512,2048,8192")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--candidates", default="", help="comma list of candidate names (default: all)")
    ap.add_argument("--out", default="act_out")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator("cuda").manual_seed(0)
    weights = [fp8_moe.make_weights(gen)[2:] for _ in range(NUM_SETS)]  # the fp8 weights and scales only
    pools = {16: [make_lora_pool(gen, 16) for _ in range(NUM_SETS)]}
    problem = MoEProblem(128, 2048, 768, 8, torch.bfloat16, torch.device("cuda"))
    report, best = [], {}
    for t in [int(v) for v in args.tokens.split(",")]:
        inputs = [make_inputs(t, gen) for _ in range(NUM_SETS)]
        loras = [lora_args(pools, i, t, "lora4_r16") for i in range(NUM_SETS)]
        shipped = fp8_plan(t, 8, problem, True)
        cands = {name: plan for name, plan in candidates(shipped).items()
                 if not args.candidates or name == "shipped" or name in args.candidates.split(",")}

        def fns(plan, with_lora):
            return [lambda w=w, inp=inp, lo=lo: fused_moe_fp8(inp[0], *w, inp[1], inp[2], act_quant=True, plan=plan,
                                                              pdl=True, lora=lo if with_lora else None)
                    for w, inp, lo in zip(weights, inputs, loras)]

        # medians of interleaved rounds; a candidate that does not compile or launch reports its error instead
        times = fp8_moe.time_interleaved({(name, lo): fns(plan, lo) for name, plan in cands.items()
                                          for lo in (False, True)}, args.rounds)
        base, base_lora = times["shipped", False], times["shipped", True]
        for name in cands:
            us, us_lora = times[name, False], times[name, True]
            if isinstance(us, str) or isinstance(us_lora, str):
                print(f"  T {t} {name}: {us if isinstance(us, str) else us_lora}", flush=True)
            else:
                report.append(dict(tokens=t, variant=name, us=us, lora_us=us_lora, vs_shipped=us / base,
                                   lora_vs_shipped=us_lora / base_lora))
                print(f"T {t:>5} {name:>15} {us:8.1f} us ({us / base:.3f}x)  with LoRA {us_lora:8.1f} us "
                      f"({us_lora / base_lora:.3f}x)", flush=True)
        fused = [r for r in report if r["tokens"] == t and r["variant"] != "shipped"]
        if fused:
            win = min(fused, key=lambda r: r["us"])
            if win["vs_shipped"] < 0.99:
                best[t] = cands[win["variant"]]
        json.dump(report, open(os.path.join(args.out, "act_in_gate_up.json"), "w"), indent=1)
        write_table(best, os.path.join(args.out, "moe_tiles_act.json"))
    print("table rows:", sorted(best))


if __name__ == "__main__":
    main()
