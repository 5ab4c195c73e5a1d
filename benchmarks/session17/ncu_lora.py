"""One fused-MoE call without LoRA and one with 4 rank-16 adapters on every row, at T tokens, inside a profiler
range, for Nsight Compute (`ncu --profile-from-start off`): the GEMMs' and shrinks' hardware counters with and
without the LoRA epilogue. Compiles (and runs once) before the range.

    ncu --profile-from-start off ... python benchmarks/session17/ncu_lora.py --tokens 256
"""
import argparse

import torch

from benchmarks.kernels import kernels as kb
from moeserve.kernels.fused_moe import fused_moe
from moeserve.kernels.moe_plan import MoEProblem, default_plan


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    (w13, w2), = [kb.make_weights(gen)]
    pool = kb.make_lora_pool(gen)
    x, tw, ti = kb.make_inputs(args.tokens, gen)
    lora = kb.lora_args(pool, args.tokens, "lora4_r16")
    problem = MoEProblem(kb.NUM_EXPERTS, kb.HIDDEN, kb.INTER, kb.TOP_K, torch.bfloat16, torch.device("cuda"))
    base = default_plan(args.tokens, kb.TOP_K, problem=problem)
    with_lora = default_plan(args.tokens, kb.TOP_K, lora=True, problem=problem)
    print("base plan", base, "\nlora plan", with_lora, flush=True)
    for _ in range(2):
        fused_moe(x, w13, w2, tw, ti, plan=base, pdl=True)
        fused_moe(x, w13, w2, tw, ti, lora, plan=with_lora, pdl=True)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fused_moe(x, w13, w2, tw, ti, plan=base, pdl=True)
    fused_moe(x, w13, w2, tw, ti, lora, plan=with_lora, pdl=True)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
