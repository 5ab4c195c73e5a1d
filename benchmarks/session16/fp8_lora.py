"""FP8 routed experts with 4 rank-16 adapters on every row (#25): the LoRA in the FP8 GEMMs' epilogues, accumulating
in place (fused_moe_fp8.lora_options up to FP8_LORA_IN_PLACE_MAX_PAIRS), against the apart pass (moe_plan.LORA_APART)
and against the FP8 call without LoRA. Qwen3-30B-A3B expert shapes, act_quant None (what the engine runs: W8A8 on the
sorted path), µs per call (CUDA graph over 4 weight sets, interleaved rounds, medians); the LoRA delta's error
against the fp32 reference on the dequantized weights; the per-kernel split of the in-place call. Also the bf16
no-LoRA call on 64-row tiles against the tuned table's at prefill sizes (`--prefill-base`): the in-place epilogue
wins there on 64-row tiles, but a LoRA call must run the no-LoRA call's tiles.

    PYTHONPATH=. python benchmarks/session16/fp8_lora.py --out DIR [--batches 16,64,...] [--prefill-base]
"""
import argparse
import json
import statistics
from dataclasses import replace

import torch

from benchmarks.kernels import fp8_moe as fb
from benchmarks.kernels import kernels as kb
from moeserve.bench.common import graph_time_us
from moeserve.kernels.fused_moe import fused_moe, fused_moe_ref
from moeserve.kernels.fused_moe_fp8 import fused_moe_fp8, lora_options
from moeserve.kernels.moe_plan import LORA_APART, LORA_IN_PLACE, GemmTile, MoEProblem, default_plan, fit_plan


def fp8_calls(weights, inputs, loras=None, lora_plan=None):
    return [lambda w=w, i=i, lora=(loras[n] if loras else None):
            fused_moe_fp8(i[0], *w[2:], i[1], i[2], act_quant=None, pdl=True, lora=lora, lora_plan=lora_plan)
            for n, (w, i) in enumerate(zip(weights, inputs))]


def delta_err(weights, inputs, lora, lora_plan, tokens=32) -> float:
    (w, i) = weights[0], inputs[0]
    n = min(tokens, i[0].shape[0])
    sub = replace(lora, token_slots=lora.token_slots[:n])
    ref = fused_moe_ref(i[0][:n], w[0], w[1], i[1][:n], i[2][:n], sub).float()
    ref_base = fused_moe_ref(i[0][:n], w[0], w[1], i[1][:n], i[2][:n]).float()
    out = fused_moe_fp8(i[0], *w[2:], i[1], i[2], act_quant=None, lora=lora, lora_plan=lora_plan)[:n].float()
    base = fused_moe_fp8(i[0], *w[2:], i[1], i[2], act_quant=None)[:n].float()
    return ((out - base - (ref - ref_base)).norm() / (ref - ref_base).norm()).item()


def bench_fp8(args, gen):
    weights = [fb.make_weights(gen) for _ in range(kb.NUM_SETS)]
    pools = [kb.make_lora_pool(gen) for _ in range(kb.NUM_SETS)]
    rows = []
    for t in map(int, args.batches.split(",")):
        inputs = [fb.make_inputs(t, gen) for _ in range(kb.NUM_SETS)]
        loras = [kb.lora_args(pools[i], t, "lora4_r16") for i in range(kb.NUM_SETS)]
        default = lora_options(t, kb.TOP_K)
        cands = {"in_place": replace(default, **LORA_IN_PLACE), "apart": replace(default, **LORA_APART)}
        times = {}
        for _ in range(args.rounds):
            times.setdefault("base", []).append(graph_time_us(fp8_calls(weights, inputs)))
            for name, lp in cands.items():
                times.setdefault(name, []).append(graph_time_us(fp8_calls(weights, inputs, loras, lp)))
        us = {k: statistics.median(v) for k, v in times.items()}
        errs = {k: delta_err(weights, inputs, loras[0], lp) for k, lp in cands.items()}
        first = next(iter(cands.values()))

        def run():
            for _ in range(3):
                for f in fp8_calls(weights, inputs, loras, first):
                    f()
        split = kb._kernel_split(run, 3 * kb.NUM_SETS)
        rows.append(dict(tokens=t, us=us, ratio={k: v / us["base"] for k, v in us.items()}, delta_err=errs,
                         split=split))
        print(f"FP8 T={t:5d} base {us['base']:7.1f} | " + "  ".join(
            f"{k}={v:.0f} ({v / us['base']:.2f}, err {errs[k]:.1e})" for k, v in us.items() if k != "base"),
            flush=True)
        print(f"   {next(iter(cands))} split (us): " + ", ".join(
            f"{n.split('_kernel')[0][-24:]} {u:.0f}" for n, _, u in split), flush=True)
    return rows


def bench_prefill_base(args, gen):
    weights = [kb.make_weights(gen) for _ in range(kb.NUM_SETS)]
    problem = MoEProblem(kb.NUM_EXPERTS, kb.HIDDEN, kb.INTER, kb.TOP_K, torch.bfloat16, torch.device("cuda"))
    rows = []
    for t in (1024, 2048, 4096, 8192):
        inputs = [kb.make_inputs(t, gen) for _ in range(kb.NUM_SETS)]
        tuned = default_plan(t, kb.TOP_K, problem=problem)
        cands = {"tuned": tuned}
        for bm, bn, bk, w, st, g in ((64, 128, 64, 4, 3, 8), (64, 128, 64, 4, 3, 1), (64, 128, 64, 4, 4, 8),
                                     (64, 128, 128, 4, 3, 8), (64, 256, 64, 8, 3, 8)):
            tile = GemmTile(bm, bn, bk, w, st, g)
            cands[f"{bm}x{bn}_k{bk}_w{w}_s{st}_g{g}"] = fit_plan(replace(tuned, gate_up=tile, down=tile),
                                                                torch.bfloat16, problem.device)
        times = {}
        for _ in range(args.rounds):
            for name, plan in cands.items():
                times.setdefault(name, []).append(kb.time_moe(weights, inputs, plan=plan, pdl=True))
        us = {k: statistics.median(v) for k, v in times.items()}
        rows.append(dict(tokens=t, us=us, plans={k: str(v) for k, v in cands.items()}))
        print(f"bf16 no-LoRA T={t:5d} | " + "  ".join(f"{k}={v:.0f} ({v / us['tuned']:.3f})" for k, v in us.items()),
              flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="16,64,256,512,1024,2048")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prefill-base", action="store_true")
    args = ap.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    out = {"device": torch.cuda.get_device_name()}
    if args.prefill_base:
        out["prefill_base"] = bench_prefill_base(args, gen)
    if args.batches:
        out["fp8"] = bench_fp8(args, gen)
    with open(f"{args.out}/fp8_lora.json", "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
