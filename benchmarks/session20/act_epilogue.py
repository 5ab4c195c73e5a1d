"""SiLU*up in the sorted gate_up GEMM's epilogue (MoEPlan.act_epilogue) against the shipped plans, at prefill sizes.

The tuned bf16 plans from T = 1,024 up run SiLU*up by its own kernel (fused_act false): the gate_up GEMM writes
gu [pairs, 2I] (201 MB at T = 8,192), the activation kernel reads it and writes h [pairs, I], the down GEMM reads h.
act_epilogue computes a tile's gate columns and their up columns in one program and stores h itself: gu and the
activation launch are gone. Its tile now holds both halves, so block_n 256 and 128 are both timed. Qwen3-30B-A3B
expert shapes, bf16, top-8 of 128, without and with 4 rank-16 adapters on every row (rank-16 pool); the whole
fused_moe, µs per call (CUDA graph over 4 weight sets, cold L2; interleaved rounds, medians). Each variant's output is
checked bitwise against the shipped plan's (the option must not change a bit on the same tiles).

    PYTHONPATH=. python benchmarks/session20/act_epilogue.py --out DIR [--batches 512,...] [--rounds 3] [--apart-n128]
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/session20/act_epilogue.py --check   # CPU: tiny shapes
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from moeserve.kernels.fused_moe import MoELoRAArgs, fused_moe, fused_moe_ref
from moeserve.kernels.moe_plan import LORA_SHRINKS_UNSPLIT, GemmTile, MoEPlan, MoEProblem, default_plan, fit_plan

LORA_CASE = "lora4_r16"  # benchmarks.kernels.kernels.LORA_CASES: 4 rank-16 adapters on every row, rank-16 pool


def variants(plan: MoEPlan, apart_n128: bool = False) -> dict[str, MoEPlan]:
    """The shipped plan, and act_epilogue on it with gate_up tiles of 256 and 128 columns (halves of 128 and 64);
    `apart_n128`: the shipped plan on 128-column gate_up tiles too, to tell the tile's share from the option's."""
    out = {"shipped": plan}
    for block_n in (256, 128):
        out[f"act_n{block_n}"] = replace(plan, act_epilogue=True, gate_up=replace(plan.gate_up, block_n=block_n))
    if apart_n128 and plan.gate_up.block_n != 128:
        out["shipped_n128"] = replace(plan, gate_up=replace(plan.gate_up, block_n=128))
    return out


def same_bits(run, plans: dict[str, MoEPlan]) -> dict[str, bool]:
    """{variant: its output bitwise the shipped plan's}; `run(plan)` -> output."""
    if "shipped" not in plans:
        return {}
    want = run(plans["shipped"])
    return {name: bool(torch.equal(run(plan), want)) for name, plan in plans.items() if name != "shipped"}


def bench_gpu(args) -> None:
    from benchmarks.kernels import kernels as kb

    t0 = time.time()
    gen = torch.Generator("cuda").manual_seed(0)
    weights = [kb.make_weights(gen) for _ in range(kb.NUM_SETS)]
    pools = {16: [kb.make_lora_pool(gen, 16) for _ in range(kb.NUM_SETS)]}
    problem = MoEProblem(kb.NUM_EXPERTS, kb.HIDDEN, kb.INTER, kb.TOP_K, torch.bfloat16, torch.device("cuda"))
    rows = []
    for tokens in map(int, args.batches.split(",")):
        inputs = [kb.make_inputs(tokens, gen) for _ in range(kb.NUM_SETS)]
        for case in ("base", "lora") if not args.no_lora else ("base",):
            loras = [kb.lora_args(pools, i, tokens, LORA_CASE) for i in range(kb.NUM_SETS)] if case == "lora" else None
            plan = default_plan(tokens, kb.TOP_K, lora=loras is not None, problem=problem)
            plans = {k: fit_plan(v, torch.bfloat16, problem.device) for k, v in variants(plan, args.apart_n128).items()}
            times = {name: [] for name in plans}
            for _ in range(args.rounds):  # interleaved: each round times every variant once
                for name, p in plans.items():
                    try:
                        times[name].append(kb.time_moe(weights, inputs, loras, plan=p, pdl=True))
                    except Exception as exc:  # shared memory / registers: reported, not fatal
                        times[name].append(float("nan"))
                        print(f"T={tokens} {case} {name}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            (w13, w2), (x, tw, ti) = weights[0], inputs[0]
            lora = loras[0] if loras else None
            us = {name: statistics.median(v) for name, v in times.items()}
            ran = {name: p for name, p in plans.items() if us[name] == us[name]}  # not the ones that failed
            bits = same_bits(lambda p: fused_moe(x, w13, w2, tw, ti, lora, plan=p, pdl=True), ran)
            rows.append(dict(tokens=tokens, case=case, us=us, bitwise_shipped=bits,
                             plans={k: asdict(v) for k, v in plans.items()}))
            shipped = us["shipped"]
            print(f"T={tokens:5d} {case:4s} shipped {shipped:8.1f} us  " + "  ".join(
                f"{k} {v:8.1f} ({v / shipped:.3f}, bits {'==' if bits.get(k) else '!='})"
                for k, v in us.items() if k != "shipped") + f"  [{time.time() - t0:.0f} s]", flush=True)
    print_table(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "act_epilogue.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                                      indent=1))


def print_table(rows: list[dict]) -> None:
    names = list(dict.fromkeys(n for r in rows for n in r["us"]))  # shipped_n128 only where the shipped tile is wider

    def cell(r, n):
        if n not in r["us"]:
            return "-"
        us = r["us"][n]
        if n == "shipped":
            return f"{us:8.1f} us"
        return f"{us:8.1f} us {us / r['us']['shipped']:.3f}{'' if r['bitwise_shipped'].get(n) else '!'}"

    print("\n" + f"{'T':>5} {'case':4} " + " ".join(f"{n:>20}" for n in names))
    for r in rows:
        print(f"{r['tokens']:5d} {r['case']:4} " + " ".join(f"{cell(r, n):>20}" for n in names))
    print("(µs per call; ratio to shipped; '!': output not bitwise the shipped plan's)")


def check_cpu() -> None:
    """Under the interpreter, the shipped prefill tile on tiny shapes (I = 48: every half tile masked past I): every
    variant against fused_moe_ref, with and without adapters (a token without one), and bitwise the shipped plan's.
    The values are dyadic, so every fp32 sum is exact and numpy's summation order (which follows the tile's width)
    cannot decide the bits: what is compared is the epilogue's rounding and formula. In fp16: bf16 kernels give
    garbage under this interpreter (the shipped plan too; the kernel tests run fp32 and fp16 for that reason)."""
    def dyadic(t, step):
        return (torch.round(t / step) * step).half()

    gen = torch.Generator().manual_seed(0)
    num_tokens, top_k, num_experts, hidden, inter, rank = 24, 2, 4, 64, 48, 16
    x = dyadic(torch.randn(num_tokens, hidden, generator=gen).clamp(-4, 4), 1 / 8)
    w13 = dyadic(torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.1, 1 / 64)
    w2 = dyadic(torch.randn(num_experts, hidden, inter, generator=gen) * 0.1, 1 / 64)
    topk_weights, topk_ids = torch.softmax(torch.randn(num_tokens, num_experts, generator=gen), -1).topk(top_k, -1)
    topk_ids = topk_ids.to(torch.int32)
    slots = (torch.arange(num_tokens) % 5 - 1).to(torch.int32)  # -1 (no adapter), 0, 1, 2, 3

    def pool(*shape, step):
        return dyadic(torch.randn(5, num_experts, *shape, generator=gen) * 0.15, step)

    lora = MoELoRAArgs(slots, torch.tensor([16, 16, 16, 16, 0], dtype=torch.int32),
                       pool(rank, hidden, step=1 / 16), pool(2 * inter, rank, step=1 / 64),
                       pool(rank, inter, step=1 / 16), pool(hidden, rank, step=1 / 64))
    tile = GemmTile(128, 256, 64, 8, 4, 1)  # the shipped bf16 tile of T = 1,024 to 4,096
    shipped = MoEPlan(False, tile, tile, y_fp32=False, fused_act=False, weights_tma=True)
    problem = (x, w13, w2, topk_weights, topk_ids)
    for adapters in (None, lora):
        plan = shipped if adapters is None else replace(shipped, **LORA_SHRINKS_UNSPLIT)
        plans = variants(plan, apart_n128=True)
        ref = fused_moe_ref(*problem, adapters).float()
        for name, p in plans.items():
            out = fused_moe(*problem, adapters, plan=p).float()
            err = ((out - ref).norm() / ref.norm()).item()
            assert err < 1e-2, (name, err)
        bits = same_bits(lambda p: fused_moe(*problem, adapters, plan=p), plans)
        assert all(bits.values()), bits
        print(f"{'lora' if adapters is not None else 'base'}: {', '.join(plans)} match fused_moe_ref; "
              f"bitwise the shipped plan: {bits}")
    print("act_epilogue check passed (interpreter)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="CPU interpreter check on tiny shapes")
    ap.add_argument("--out", help="directory for act_epilogue.json (GPU)")
    ap.add_argument("--batches", default="512,1024,2048,4096,8192")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-lora", action="store_true", help="without the 4-adapter case")
    ap.add_argument("--apart-n128", action="store_true", help="also the shipped plan on 128-column gate_up tiles")
    args = ap.parse_args(argv)
    if args.check:
        check_cpu()
        return 0
    if not args.out:
        ap.error("--out is required on the GPU")
    bench_gpu(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
