"""The W8A8 expert GEMMs with their K step's scales loaded one step ahead, with and without the table's register cap
(173 registers -> 168: 2 -> 3 CTAs per SM at 64 x 128 x 128, 4 warps, 3 stages), at T = 256 ... 8,192, interleaved
(A, B, A, B), graphs over 4 weight sets (fp8_moe.py's), µs; bf16 beside.

    PYTHONPATH=. python benchmarks/session18/fp8_regs.py
"""
import statistics
from dataclasses import replace

import torch

from benchmarks.kernels import fp8_moe as fb
from moeserve.bench.common import graph_time_us
from moeserve.kernels.fused_moe import fused_moe
from moeserve.kernels.fused_moe_fp8 import fp8_plan, fused_moe_fp8
from moeserve.kernels.moe_plan import MoEProblem

gen = torch.Generator("cuda").manual_seed(0)
weights = [fb.make_weights(gen) for _ in range(fb.NUM_SETS)]
problem = MoEProblem(fb.NUM_EXPERTS, fb.HIDDEN, fb.INTER, fb.TOP_K, torch.bfloat16, torch.device("cuda"))
for T in (256, 1024, 2048, 4096, 8192):
    inputs = [fb.make_inputs(T, gen) for _ in weights]
    plan = fp8_plan(T, fb.TOP_K, problem, True)
    variants = {"bf16": None, "fp8_table": plan, "fp8_uncapped": replace(plan, max_registers=0)}
    fns = {}
    for name, p in variants.items():
        if p is None:
            fns[name] = [lambda w=w, i=i: fused_moe(i[0], w[0], w[1], i[1], i[2], pdl=True) for w, i in zip(weights, inputs)]
        else:
            fns[name] = [lambda w=w, i=i, p=p: fused_moe_fp8(i[0], *w[2:], i[1], i[2], act_quant=True, plan=p, pdl=True)
                         for w, i in zip(weights, inputs)]
    times = {name: [] for name in fns}
    for _ in range(3):
        for name, f in fns.items():
            times[name].append(graph_time_us(f))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"T={T:5d} cap {plan.max_registers}: " + "  ".join(f"{k} {v:.1f}" for k, v in med.items())
          + f"  bf16/fp8 {med['bf16'] / med['fp8_table']:.2f}", flush=True)
