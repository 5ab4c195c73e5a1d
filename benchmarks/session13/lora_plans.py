"""Routed experts with 4 rank-16 adapters on every row, on the plans the engine runs today (tuned table, TMA weight
tiles) and on candidates around them, with each plan's per-kernel split: what #24 item 2 (MoE + LoRA <= 1.2x the
MoE alone at T >= 64) has to beat. Qwen3-30B-A3B expert shapes, bf16, µs per call (CUDA graph over 4 weight sets,
interleaved rounds, medians); the split is the torch profiler over eager calls of the engine's plan.

Candidates: the engine's plan with each expert's rows in adapter-slot order (MoEPlan.lora_slot_sorted; above 256
tokens also with the expands walking items one by one, which sorted rows make fewer); at T <= 256 (the epilogue
plans) the tuned base tiles with the epilogue instead of the heuristic's, and the apart expands; above, the epilogue
on 128 x 128 and 64 x 128 tiles (accumulators that leave registers for it), beside the apart expands the engine
runs.

    PYTHONPATH=. python benchmarks/session13/lora_plans.py --out DIR [--batches 256,512,2048,8192]

The slot-sorted prototype lost in the engine's prefill (session 14, call 2) and was removed after it: the script
runs on a tree before that removal (e.g. 0e271a4).
"""
import argparse
import json
import statistics
from dataclasses import replace

import torch

from benchmarks.kernels import kernels as kb
from moeserve.kernels.fused_moe import fused_moe
from moeserve.kernels.moe_plan import LORA_APART, GemmTile, MoEProblem, default_plan, fit_plan


def candidates(t: int, problem: MoEProblem) -> dict:
    engine = default_plan(t, kb.TOP_K, lora=True, problem=problem)
    base = default_plan(t, kb.TOP_K, problem=problem)
    out = {"engine": engine}
    # each expert's rows in adapter-slot order (MoEPlan.lora_slot_sorted, torch alignment: its extra launches are
    # in these times): fewer slots per row tile, fewer LoRA items walked
    out["engine_slot_sorted"] = replace(engine, lora_slot_sorted=True)
    if not engine.lora_epilogue:
        out["apart_slot_sorted_walk"] = replace(engine, lora_slot_sorted=True, lora_epilogue_items=0)
    if engine.lora_epilogue:
        out["epi_tuned_tiles_i4"] = replace(engine, gate_up=base.gate_up, down=base.down, lora_epilogue_items=4)
        out["epi_tuned_tiles_i2"] = replace(engine, gate_up=base.gate_up, down=base.down, lora_epilogue_items=2)
        out["apart_tuned_tiles"] = replace(base, **LORA_APART)
    else:
        for m, n, w in ((128, 128, 8), (64, 128, 4), (64, 128, 8)):
            tile = GemmTile(m, n, 64, w, 3, 8)
            for items in (0, 4):
                out[f"epi_{m}x{n}w{w}_i{items}"] = replace(engine, gate_up=tile, down=tile, lora_epilogue=True,
                                                          lora_epilogue_items=items, lora_gate_up_splits=4,
                                                          lora_down_splits=2)
    return {k: fit_plan(v, torch.bfloat16, problem.device) for k, v in out.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="64,256,512,2048,8192")
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
        ref = kb.lora_reference(weights, inputs, loras[0], tokens=32)
        base_plan = default_plan(t, kb.TOP_K, problem=problem)
        cands = candidates(t, problem)
        times = {}
        for _ in range(args.rounds):
            times.setdefault("base", []).append(kb.time_moe(weights, inputs, plan=base_plan, pdl=True))
            for name, plan in cands.items():
                try:
                    times.setdefault(name, []).append(kb.time_moe(weights, inputs, loras, plan=plan, pdl=True))
                except Exception as e:  # registers / shared memory: reported, not fatal
                    times[name] = [float("nan")]
                    print(f"T={t} {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        base = statistics.median(times.pop("base"))
        us = {k: statistics.median(v) for k, v in times.items()}
        errs = {k: kb.lora_errors(weights, inputs, loras[0], cands[k], ref).get("delta_rel_err")
                for k in us if us[k] == us[k]}
        engine = cands["engine"]

        def calls():
            for _ in range(3):
                for i, ((w13, w2), (x, tw, ti)) in enumerate(zip(weights, inputs)):
                    fused_moe(x, w13, w2, tw, ti, loras[i], plan=engine, pdl=True)
        split = kb._kernel_split(calls, 3 * kb.NUM_SETS)
        rows.append(dict(tokens=t, base_us=base, us=us, ratio={k: v / base for k, v in us.items()}, delta_err=errs,
                         engine_plan=str(engine), engine_split=split))
        print(f"T={t:5d} base {base:7.1f} | " + "  ".join(f"{k}={v:.0f} ({v / base:.2f})" for k, v in us.items()),
              flush=True)
        print("   engine split (us): " + ", ".join(f"{n.split('_kernel')[0][-28:]} {u:.0f}" for n, _, u in split),
              flush=True)
    with open(f"{args.out}/lora_plans.json", "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
