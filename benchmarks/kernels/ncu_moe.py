"""One fused-MoE call without LoRA and one with 4 rank-16 adapters on every row (rank-16 pool), at T tokens, bf16 or
block-FP8 weights, inside a CUDA profiler range, for Nsight Compute: the GEMMs', shrinks' and helper kernels'
hardware counters with and without the LoRA. Everything compiles and runs twice before the range; inside it each
call runs once, so `ncu --profile-from-start off` sees exactly one launch of each kernel per call.

    ncu --clock-control none --profile-from-start off -k 'regex:_moe_|_lora_block_shrink' --set full \\
        --import-source yes -f -o OUT python -m benchmarks.kernels.ncu_moe --tokens 256 [--fp8] [--no-lora]
    ncu --import OUT.ncu-rep --page details            # per kernel: duration, registers, occupancy, stalls
    ncu --import OUT.ncu-rep --page source --csv --print-source sass   # stall samples per instruction

(Leave the clocks alone: `--clock-control none`.) Qwen3-30B-A3B expert shapes (H 2048, I 768, E 128, top-8);
FP8 runs what the engine runs (W8A8 on the sorted path, weight-only GEMVs).
"""
import argparse

import torch

from benchmarks.kernels import kernels as kb


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels.ncu_moe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--fp8", action="store_true", help="block-FP8 expert weights (fused_moe_fp8)")
    ap.add_argument("--no-lora", dest="lora", action="store_false", help="only the call without adapters")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("ncu_moe needs a CUDA device")
    gen = torch.Generator("cuda").manual_seed(0)
    pools = {16: [kb.make_lora_pool(gen, 16)]}
    lora = kb.lora_args(pools, 0, args.tokens, "lora4_r16") if args.lora else None
    if args.fp8:
        from benchmarks.kernels import fp8_moe as fb
        from moeserve.kernels.fused_moe_fp8 import fused_moe_fp8

        _, _, q13, s13, q2, s2 = fb.make_weights(gen)
        x, tw, ti = fb.make_inputs(args.tokens, gen)

        def call(adapters):
            return fused_moe_fp8(x, q13, s13, q2, s2, tw, ti, act_quant=None, lora=adapters, pdl=True)
    else:
        from moeserve.kernels.fused_moe import fused_moe

        w13, w2 = kb.make_weights(gen)
        x, tw, ti = kb.make_inputs(args.tokens, gen)

        def call(adapters):
            return fused_moe(x, w13, w2, tw, ti, adapters, pdl=True)
    calls = [None] + ([lora] if lora is not None else [])
    for _ in range(2):  # compile, then once more warm
        for adapters in calls:
            call(adapters)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for adapters in calls:
        call(adapters)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
