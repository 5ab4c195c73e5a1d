"""One fused MoE call with four rank-16 adapters (every row on one) at T = 8,192 with the expands apart, between
cudaProfilerStart/Stop, for Nsight Compute (`ncu --profile-from-start off`): where the two expand kernels' ~1 ms
goes (session 10 measured them at ~1 ms where their bytes take ~150-200 us). Also prints each Triton kernel's
registers and spills.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight ... \
        python benchmarks/session11_2026-12-01/expand_ncu.py
"""
from dataclasses import replace

import torch

from benchmarks.kernels import kernels as kb
from moeserve.kernels import moe_lora
from moeserve.kernels.fused_moe import fused_moe
from moeserve.kernels.moe_plan import LORA_APART, MoEProblem, default_plan

gen = torch.Generator("cuda").manual_seed(0)
w13, w2 = kb.make_weights(gen)
pool = kb.make_lora_pool(gen)
problem = MoEProblem(kb.NUM_EXPERTS, kb.HIDDEN, kb.INTER, kb.TOP_K, torch.bfloat16, torch.device("cuda"))
t = 8192
x, tw, ti = kb.make_inputs(t, gen)
lora = kb.lora_args(pool, t, "lora4_r16")
plan = default_plan(t, kb.TOP_K, lora=True, problem=problem)
assert not plan.lora_epilogue, plan
for _ in range(3):
    fused_moe(x, w13, w2, tw, ti, lora, plan=plan, pdl=False)
torch.cuda.synchronize()
for kern in (moe_lora._lora_expand_act_kernel, moe_lora._lora_expand_down_kernel):
    try:
        for cache in kern.device_caches.values():
            for compiled in cache[0].values():
                print(f"{kern.fn.__name__}: {compiled.n_regs} registers, {compiled.n_spills} spills, "
                      f"{compiled.metadata.shared} B shared", flush=True)
    except Exception as e:  # Triton's internals differ between versions: the registers are a bonus
        print(f"{kern.fn.__name__}: no register count ({e!r})")
torch.cuda.cudart().cudaProfilerStart()
fused_moe(x, w13, w2, tw, ti, lora, plan=plan, pdl=False)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
