"""Routed experts with 4 rank-16 adapters on every row: the engine's LoRA plans against the epilogue that
accumulates into the GEMM's own accumulator (MoEPlan.lora_in_place) on the tuned no-LoRA tiles, which would let
every T keep the fused SiLU*up and write gu and y once (the apart expands above 2,048 pairs read and write both
again). Qwen3-30B-A3B expert shapes, bf16, µs per call (CUDA graph over 4 weight sets, interleaved rounds,
medians), the LoRA delta's error against the fp32 reference, and the per-kernel split of the best candidate.

    PYTHONPATH=. python benchmarks/session16/lora_inplace.py --out DIR [--batches 64,256,...] [--candidates fused]

`--candidates shrinks`: the engine's in-place plan with its shrinks split over K, over more or fewer lanes, in 2
warps, in 64-column steps. `--candidates prefill`: the in-place epilogue on 64- and 32-row tiles (group 8) at
prefill sizes, against the engine's apart plan (the tuned 128-row tiles lose with it). `--candidates prologue`: the
in-place expands before the main loop (MoEPlan.lora_prologue, commit 2c25622 only) on the tuned tiles, against apart
and the epilogue. `--candidates slots_early` (call 6): the engine's plan with the epilogue's slots and ranks
loaded before the main loop (MoEPlan.lora_slots_early, commit 7778e2a only), and with 256-column shrink
steps. `--candidates fused` (call 2): the shrinks in the GEMMs' main loops
(MoEPlan.lora_fused_shrink, commit 22030e3 only) on the tuned and on smaller tiles, against call 1's best.
"""
import argparse
import json
import statistics
from dataclasses import replace

import torch

from benchmarks.kernels import kernels as kb
from moeserve.kernels.fused_moe import fused_moe
from moeserve.kernels.moe_plan import GemmTile, MoEProblem, default_plan, fit_plan


def candidates(t: int, problem: MoEProblem, which: str = "in_place") -> dict:
    engine = default_plan(t, kb.TOP_K, lora=True, problem=problem)
    base = default_plan(t, kb.TOP_K, problem=problem)
    tuned = replace(base, lora_epilogue=True, lora_in_place=True)
    out = {"engine": engine}
    if which == "engine":  # call 3: the engine's plan alone (after it took the winner)
        return {k: fit_plan(v, torch.bfloat16, problem.device) for k, v in out.items()}
    if which == "shrinks":  # next: the in-place plan's shrinks split over K, over lanes, in fewer warps
        for gu, dn in ((2, 1), (4, 1), (2, 2), (4, 2)):
            out[f"split_{gu}{dn}"] = replace(engine, lora_gate_up_splits=gu, lora_down_splits=dn)
        for lanes in (1, 2, 8):
            out[f"lanes_{lanes}"] = replace(engine, lora_shrink_lanes=lanes)
        out["warps_2"] = replace(engine, lora_shrink_warps=2)
        out["block_k_64"] = replace(engine, lora_shrink_block_k=64)
        return {k: fit_plan(v, torch.bfloat16, problem.device) for k, v in out.items()}
    if which == "slots_early":  # next: the epilogue's slots and ranks loaded before the main loop; 256-column shrink steps
        out["slots_early"] = replace(engine, lora_slots_early=True)
        out["shrink_k256"] = replace(engine, lora_shrink_block_k=256)
        out["slots_early_shrink_k256"] = replace(engine, lora_slots_early=True, lora_shrink_block_k=256)
        return {k: fit_plan(v, torch.bfloat16, problem.device) for k, v in out.items()}
    if which == "prologue":  # the in-place expands before the main loop, on the tuned (128-row) tiles
        for items in (1, 2):
            out[f"prologue_i{items}"] = replace(engine, lora_epilogue=True, lora_in_place=True, lora_prologue=True,
                                                lora_epilogue_items=items, lora_gate_up_splits=1, lora_down_splits=1)
        out["epilogue_i1"] = replace(out["prologue_i1"], lora_prologue=False)
        return {k: fit_plan(v, torch.bfloat16, problem.device) for k, v in out.items()}
    if which == "prefill":  # the in-place epilogue on 64- and 32-row tiles at prefill sizes, against apart
        for bm, bn_gu, bn_dn, bk, w, st in ((64, 128, 128, 64, 4, 3), (64, 128, 128, 64, 8, 3),
                                             (64, 128, 256, 64, 8, 3), (64, 256, 256, 64, 8, 3),
                                             (32, 128, 128, 64, 4, 4), (32, 128, 128, 128, 4, 3)):
            plan = replace(engine, gate_up=GemmTile(bm, bn_gu, bk, w, st, 8), down=GemmTile(bm, bn_dn, bk, w, st, 8),
                           lora_epilogue=True, lora_in_place=True, lora_epilogue_items=1, lora_gate_up_splits=1,
                           lora_down_splits=1)
            out[f"in_place_{bm}x{bn_gu}x{bn_dn}_k{bk}_w{w}_s{st}"] = plan
        return {k: fit_plan(v, torch.bfloat16, problem.device) for k, v in out.items()}
    if which == "fused":  # call 2: the shrinks in the GEMMs' main loops, against call 1's best (in place, 2 items)
        out["tuned_in_place_i2_s11"] = replace(tuned, lora_epilogue_items=2, lora_gate_up_splits=1,
                                               lora_down_splits=1)
        out["tuned_in_place_i1_s11"] = replace(tuned, lora_epilogue_items=1, lora_gate_up_splits=1,
                                               lora_down_splits=1)
        for items in (4, 8):
            out[f"tuned_fused_i{items}"] = replace(tuned, lora_in_place=False, lora_fused_shrink=True,
                                                   lora_epilogue_items=items)
        heur = replace(engine, lora_epilogue=True, lora_in_place=False, lora_fused_shrink=True, lora_epilogue_items=4)
        if engine.gate_up.block_m == 16:
            out["heuristic_fused_i4"] = heur
        for bm, bn, w in ((16, 64, 4), (32, 128, 4), (64, 128, 4)):
            tile = GemmTile(bm, bn, 128 if bm <= 32 else 64, w, 3, 4)
            out[f"fused_{bm}x{bn}_i4"] = replace(heur, gate_up=tile, down=tile)
        return {k: fit_plan(v, torch.bfloat16, problem.device) for k, v in out.items()}
    for items in (2, 4, 8):
        for splits in ((4, 2), (1, 1)):
            out[f"tuned_i{items}_s{splits[0]}{splits[1]}"] = replace(
                tuned, lora_epilogue_items=items, lora_gate_up_splits=splits[0], lora_down_splits=splits[1])
    if engine.lora_epilogue:  # the heuristic LoRA tiles, accumulating in place
        out["engine_in_place"] = replace(engine, lora_in_place=True, lora_epilogue_items=max(
            2, engine.lora_epilogue_items))
    return {k: fit_plan(v, torch.bfloat16, problem.device) for k, v in out.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="64,256,512,1024,2048,4096,8192")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--candidates", default="in_place", choices=("in_place", "fused", "engine", "shrinks", "prefill", "prologue", "slots_early"))
    ap.add_argument("--split-pdl", action=argparse.BooleanOptionalAction, default=True,
                    help="the best plan's per-kernel split with PDL (each kernel's span then includes its wait for "
                         "the one before) or without")
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
        cands = candidates(t, problem, args.candidates)
        times = {}
        for _ in range(args.rounds):
            times.setdefault("base", []).append(kb.time_moe(weights, inputs, plan=base_plan, pdl=True))
            for name, plan in cands.items():
                if times.get(name) == [float("nan")]:
                    continue
                try:
                    times.setdefault(name, []).append(kb.time_moe(weights, inputs, loras, plan=plan, pdl=True))
                except Exception as e:  # registers / shared memory: reported, not fatal
                    times[name] = [float("nan")]
                    print(f"T={t} {name}: {type(e).__name__}: {str(e)[:160]}", flush=True)
        base = statistics.median(times.pop("base"))
        us = {k: statistics.median(v) for k, v in times.items()}
        errs = {k: kb.lora_errors(weights, inputs, loras[0], cands[k], ref).get("delta_rel_err")
                for k in us if us[k] == us[k]}
        best = min((k for k in us if us[k] == us[k]), key=us.get)

        def calls(plan):
            def run():
                for _ in range(3):
                    for i, ((w13, w2), (x, tw, ti)) in enumerate(zip(weights, inputs)):
                        fused_moe(x, w13, w2, tw, ti, loras[i], plan=plan, pdl=args.split_pdl)
            return run
        split = kb._kernel_split(calls(cands[best]), 3 * kb.NUM_SETS)
        rows.append(dict(tokens=t, base_us=base, us=us, ratio={k: v / base for k, v in us.items()}, delta_err=errs,
                         plans={k: str(v) for k, v in cands.items()}, best=best, best_split=split))
        print(f"T={t:5d} base {base:7.1f} | " + "  ".join(f"{k}={v:.0f} ({v / base:.2f})" for k, v in us.items()),
              flush=True)
        print(f"   errors: " + "  ".join(f"{k}={v:.1e}" for k, v in errs.items() if v is not None), flush=True)
        print(f"   {best} split (us): " + ", ".join(f"{n.split('_kernel')[0][-28:]} {u:.0f}" for n, _, u in split),
              flush=True)
    with open(f"{args.out}/lora_{args.candidates}.json", "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
