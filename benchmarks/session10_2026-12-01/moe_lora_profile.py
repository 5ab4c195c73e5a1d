"""Per-kernel CUDA time of the fused MoE with four rank-16 adapters (every row on one) at prefill sizes: the LoRA
plan in the GEMM epilogues against the expands apart (MoEPlan.lora_epilogue=False), Qwen3-30B-A3B expert shapes.

    PYTHONPATH=. python benchmarks/session10_2026-12-01/moe_lora_profile.py
"""
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from moeserve.bench import kernels as kb
from moeserve.kernels.fused_moe import fused_moe
from moeserve.kernels.moe_plan import MoEProblem, default_plan

gen = torch.Generator("cuda").manual_seed(0)
w13, w2 = kb.make_weights(gen)
pool = kb.make_lora_pool(gen)
problem = MoEProblem(kb.NUM_EXPERTS, kb.HIDDEN, kb.INTER, kb.TOP_K, torch.bfloat16, torch.device("cuda"))
for t in (2048, 8192):
    x, tw, ti = kb.make_inputs(t, gen)
    lora = kb.lora_args(pool, t, "lora4_r16")
    base = default_plan(t, kb.TOP_K, problem=problem)
    plans = {"base": (base, None), "epilogue": (default_plan(t, kb.TOP_K, lora=True, problem=problem), lora),
             "apart": (replace(base, lora_epilogue=False, lora_epilogue_items=4), lora)}
    for name, (plan, lo) in plans.items():
        for _ in range(3):
            fused_moe(x, w13, w2, tw, ti, lo, plan=plan, pdl=False)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fused_moe(x, w13, w2, tw, ti, lo, plan=plan, pdl=False)
            torch.cuda.synchronize()
        rows = sorted(((e.key, e.device_time_total / 5) for e in prof.key_averages() if e.device_time_total > 0),
                      key=lambda r: -r[1])
        print(f"T={t} {name}: total {sum(r[1] for r in rows):.0f} us | "
              + " | ".join(f"{k[:28]} {v:.0f}" for k, v in rows[:7]), flush=True)
