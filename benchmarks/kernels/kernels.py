"""Fused MoE and MoE-LoRA kernels at Qwen3-30B-A3B decode shapes (H 2048, I 768, E 128, top-8).

    python -m benchmarks.kernels.kernels [--batches 1,8,32,64,128,256,512] [--out bench_out/]
                                     [--sweep] [--lora-sweep [--lora-variants 'splits*']] [--profile] [--no-pdl]
                                     [--parts moe,router,dense_lora,norm_rotary,gemv]

Measures, in one process on one GPU:
- read bandwidth: a large device-to-device copy (read + write counted) and a large
  read-only reduction; the reduction is the ceiling the MoE is compared with;
- per batch: fused MoE time (CUDA-graph replay, rotating through 4 sets of weights and
  inputs, each 1.2 GB, so L2 never holds a set), expected touched expert bytes
  E*(1-(1-K/E)^T)*3*H*I*2, achieved GB/s and fraction of read bandwidth;
- MoE-LoRA with 1, 4 and 8 active rank-16 adapters (every token has one) in a max-rank-16 pool (the
  engine's default), 4 of them and one rank-8 adapter in a max-rank-64 pool (LORA_CASES), each as
  (fused MoE + LoRA) / (fused MoE alone), the modes
  interleaved (MoE, MoE + LoRA, MoE, ...; medians), with the adapter bytes the routing
  touches, their time at read bandwidth, and the error against the fp32 per-pair reference
  (first 64 tokens): max |out - ref| / max |ref| and the relative error of the LoRA delta itself;
- the alignment kernel against its torch reference.
`--sweep` also times block-size candidates and both paths per batch, and the sorted-path LoRA
tiles (`--lora-sweep` runs only the latter: shrink K step, splits, lanes, warps, base tiles; all
timed in turn twice, medians; a table of the variants last);
`--profile` prints per-kernel GPU time per forward at T = 8, 64, 256 for MoE alone and MoE + 4
adapters (the LoRA call's default plan, each profiled alone), the gate_up and down
shrinks named apart, and a table of the shrink / GEMM split last. Prints the tables last, writes
kernels_bench.json.

`--parts router` times the MoE routing (router GEMM, softmax, top-k, renorm, cast) at T = 1, 8, 64,
256, 512: the torch code, the linear layer + `fused_topk`, and `fused_gemm_topk` at a few tiles,
each over enough router weights (cold L2, as between layers) in one CUDA graph; writes router_bench.json.
Names ending in `:3red` select top-k with the previous three reductions per pick (`packed_topk=False`) instead
of one max over packed keys: the same result, the routing tail's cost.
Part `dense_lora` (benchmarks.kernels.dense_lora) times the dense multi-LoRA paths first, with its own table.
Part `norm_rotary` (norm_kernels.py): the fused RMSNorm, residual add + RMSNorm and q/k norm +
rotary + KV write kernels against the torch code they replace at T = 1, 8, 64, 256, 512; its own table
and norm_rotary_bench.json.
Part `gemv` (gemv.py): the Triton GEMV against cuBLAS for the dense projections of the presets at
T = 1, 2 (the rows it serves), with and without the fused LoRA expand (`--sweep`: a config sweep, best per shape);
its own table and gemv_bench.json. Not in the default parts: `--parts gemv [--sweep]`.
"""

import argparse
import fnmatch
import json
import statistics
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path

import torch

from benchmarks.kernels import dense_lora
from moeserve.bench.common import bandwidths, graph_time_us
from moeserve.kernels.fused_moe import MoELoRAArgs, fused_moe, fused_moe_ref
from moeserve.kernels.moe_plan import GemmTile, MoEPlan, MoEProblem, default_plan
from moeserve.kernels.moe_align import moe_align, moe_align_ref
from moeserve.kernels.pdl import supported as pdl_supported
from moeserve.kernels.router import (
    GEMM_TOPK_MAX_TOKENS,
    RouterTile,
    counter_slots,
    fused_gemm_topk,
    fused_topk,
    fused_topk_ref,
)

HIDDEN, INTER, NUM_EXPERTS, TOP_K = 2048, 768, 128, 8
DEVICE = "cuda"
NUM_SETS = 4  # weight/input sets one timed graph rotates through (each >> L2)
LORA_SLOTS, LORA_MAX_RANK = 8, 64
POOL_RANKS = (16, 64)  # the pools' max ranks: the engine's default --max-lora-rank, and a larger one
# name -> (rank of each slot, adapters in use, up A's: None = pool without them, else per-slot flags, pool max rank).
# The rank-16 pool is what the engine allocates by default; in a rank-64 one, rank-16 adapters read about twice their
# B bytes (lora4_r16_of_64; sessions before 17 measured every case in it)
LORA_CASES = {
    "lora1_r16": ([16] + [0] * 7, 1, None, 16),
    "lora4_r16": ([16] * 4 + [0] * 4, 4, None, 16),
    "lora8_r16": ([16] * 8, 8, None, 16),
    "lora4_r16_of_64": ([16] * 4 + [0] * 4, 4, None, 64),
    "lora1_r8_of_64": ([8] + [0] * 7, 1, None, 64),
    # lora_separate_gate_up pools: 4 adapters with separate gate and up A's (two gate_up shrinks each), and 4
    # with one A (what fused gate_up adapters pay for the option: should equal lora4_r16)
    "lora4_r16_sep": ([16] * 4 + [0] * 4, 4, [1] * 8, 16),
    "lora4_r16_sep1A": ([16] * 4 + [0] * 4, 4, [0] * 8, 16),
}


def read_bandwidth() -> dict:
    """GB/s of a 4 GiB copy (read + write) and of a 4 GiB read-only sum."""
    copy_bps, read_bps = bandwidths()
    return {"copy_gbps": copy_bps / 1e9, "read_gbps": read_bps / 1e9}


def touched_bytes(batch: int) -> float:
    expected_experts = NUM_EXPERTS * (1 - (1 - TOP_K / NUM_EXPERTS) ** batch)
    return expected_experts * 3 * HIDDEN * INTER * 2


def make_weights(gen):
    def normal(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE, dtype=torch.bfloat16) * 0.02

    return normal(NUM_EXPERTS, 2 * INTER, HIDDEN), normal(NUM_EXPERTS, HIDDEN, INTER)


def make_lora_pool(gen, max_rank: int = LORA_MAX_RANK):
    """Full-size pool; slot ranks decide which columns the kernels read. The engine's pool has the rank of
    --max-lora-rank (16 by default): a B row of a rank-64 pool is 128 bytes of which rank-16 adapters use 32, and the
    H200 reads such rows' B about twice over (64-byte DRAM reads)."""
    def normal(*shape):
        return torch.randn(LORA_SLOTS, NUM_EXPERTS, *shape, generator=gen, device=DEVICE,
                           dtype=torch.bfloat16) * 0.02

    return (normal(max_rank, HIDDEN), normal(2 * INTER, max_rank),
            normal(max_rank, INTER), normal(HIDDEN, max_rank), normal(max_rank, HIDDEN))


def make_inputs(batch: int, gen):
    x = torch.randn(batch, HIDDEN, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    logits = torch.randn(batch, NUM_EXPERTS, generator=gen, device=DEVICE)
    weights, ids = torch.softmax(logits, -1).topk(TOP_K, -1)
    return x, weights, ids.to(torch.int32)


def lora_args(pools: dict, i: int, batch: int, case: str) -> MoELoRAArgs:
    """The LoRA of `case` on weight set i: its slots and ranks over the case's pool ({max rank: [pool per set]})."""
    ranks, in_use, separate, pool_rank = LORA_CASES[case]
    slots = (torch.arange(batch, device=DEVICE) % in_use).to(torch.int32)
    *factors, up_a = pools[pool_rank][i]
    flags = None if separate is None else torch.tensor(separate, dtype=torch.int32, device=DEVICE)
    return MoELoRAArgs(slots, torch.tensor(ranks, dtype=torch.int32, device=DEVICE), *factors,
                       None if separate is None else up_a, flags)


def time_moe(weights, inputs, loras=None, **kw) -> float:
    """Graph replay of fused_moe over the weight sets; kw: fused_moe's (plan, decode, pdl)."""
    fns = []
    for i, ((w13, w2), (x, tw, ti)) in enumerate(zip(weights, inputs)):
        lora = loras[i] if loras else None
        fns.append(lambda w13=w13, w2=w2, x=x, tw=tw, ti=ti, lora=lora:
                   fused_moe(x, w13, w2, tw, ti, lora, **kw))
    return graph_time_us(fns)


SWEEP_TILES = [  # sorted path: gate_up and down (block_m, block_n, block_k, num_warps, num_stages)
    ((16, 128, 128, 4, 3),) * 2, ((16, 64, 128, 4, 4),) * 2, ((16, 128, 128, 4, 4),) * 2,
    ((16, 128, 64, 4, 4),) * 2, ((16, 128, 128, 4, 3), (16, 256, 64, 8, 3)),
    ((32, 128, 128, 4, 3),) * 2, ((32, 128, 64, 4, 4),) * 2,
    ((64, 128, 64, 8, 3),) * 2, ((64, 128, 128, 8, 3),) * 2,
    ((64, 128, 64, 8, 3), (64, 256, 64, 8, 3)),
    # large-B candidates: 32-row blocks (fewer second blocks per expert at T >= 256), 8 warps, wider N
    ((32, 128, 64, 4, 3),) * 2, ((32, 64, 128, 4, 3),) * 2, ((32, 128, 128, 8, 3),) * 2,
    ((32, 128, 64, 4, 3), (32, 256, 64, 8, 3)), ((16, 256, 64, 8, 3),) * 2, ((32, 128, 64, 8, 4),) * 2,
]
SWEEP_GEMV = [  # decode path: (block_n, block_k, num_warps, num_stages)
    (16, 256, 4, 1), (32, 128, 4, 1), (16, 128, 4, 1), (32, 256, 8, 1),
]


def _tile_label(row: dict) -> str:
    def one(t):
        if len(t) == 4:
            return "n{}k{}w{}s{}".format(*t)
        return "m{}n{}k{}w{}s{}".format(*t)

    if row["path"] == "decode":
        return "gemv:" + one(row["tile"])
    gate_up, down = row["tile"]
    return one(gate_up) if gate_up == down else one(gate_up) + "|" + one(down)


def engine_plan(batch: int, lora: bool = False, decode: bool | None = None) -> MoEPlan:
    """The plan the engine runs at this batch: the tuned table's tiles for this GPU and shape (bf16), else the
    heuristic's."""
    problem = MoEProblem(NUM_EXPERTS, HIDDEN, INTER, TOP_K, torch.bfloat16, torch.device(DEVICE))
    return default_plan(batch, TOP_K, decode, lora=lora, problem=problem)


def _try_time(rows: list, label: dict, *args, **kw) -> None:
    try:
        rows.append({**label, "us": time_moe(*args, **kw)})
    except Exception as exc:  # a candidate that does not compile is skipped, not fatal
        print(f"  sweep {label} failed: {exc!r}"[:300], flush=True)


def sweep(batch: int, weights, inputs, pdl: bool) -> list[dict]:
    rows = []
    if batch * TOP_K <= 256:
        for bn, bk, nw, ns in SWEEP_GEMV:
            tile = GemmTile(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
            _try_time(rows, {"path": "decode", "tile": [bn, bk, nw, ns]}, weights, inputs,
                      plan=MoEPlan(True, tile, tile), pdl=pdl)
    for gate_up, down in SWEEP_TILES:
        if gate_up[0] > 16 and batch * TOP_K < 512:
            continue
        plan = MoEPlan(False, GemmTile(*gate_up), GemmTile(*down))
        _try_time(rows, {"path": "sorted", "tile": [gate_up, down]}, weights, inputs, plan=plan, pdl=pdl)
    return rows


def lora_touched_bytes(lora: MoELoRAArgs, topk_ids) -> float:
    """Adapter bytes the routing touches: each (slot, expert) weight set, rank columns only."""
    slots = lora.token_slots.long()[:, None].expand_as(topk_ids)
    ranks = lora.slot_ranks.long()[slots.clamp(min=0)]
    keys = (slots * NUM_EXPERTS + topk_ids.long())[(slots >= 0) & (ranks > 0)].unique()
    per_rank = (HIDDEN + 2 * INTER + INTER + HIDDEN) * 2
    total = float(lora.slot_ranks.long()[keys // NUM_EXPERTS].sum()) * per_rank
    if lora.up_a is not None:  # the up A's of separate slots
        sep = lora.gate_up_separate.long()[keys // NUM_EXPERTS]
        total += float((lora.slot_ranks.long()[keys // NUM_EXPERTS] * sep).sum()) * HIDDEN * 2
    return total


def lora_reference(weights, inputs, lora: MoELoRAArgs, tokens: int = 64):
    """fp32 per-pair reference with and without the adapters, first `tokens` tokens of set 0
    (rows are independent; the reference is a Python loop over pairs)."""
    (w13, w2), (x, tw, ti) = weights[0], inputs[0]
    n = min(tokens, x.shape[0])
    sub = MoELoRAArgs(lora.token_slots[:n], lora.slot_ranks, lora.gate_up_a, lora.gate_up_b,
                      lora.down_a, lora.down_b, lora.up_a, lora.gate_up_separate)
    ref = fused_moe_ref(x[:n], w13, w2, tw[:n], ti[:n], sub).float()
    return ref, fused_moe_ref(x[:n], w13, w2, tw[:n], ti[:n]).float()


def lora_errors(weights, inputs, lora: MoELoRAArgs, plan: MoEPlan, reference) -> dict:
    """Max |out - ref| / max |ref|, and the relative error of the LoRA delta (LoRA-on minus
    LoRA-off on both sides), on the rows of `reference` (lora_reference)."""
    (w13, w2), (x, tw, ti) = weights[0], inputs[0]
    ref, ref_base = reference
    n = ref.shape[0]
    out = fused_moe(x, w13, w2, tw, ti, lora, plan=plan)[:n].float()
    base = fused_moe(x, w13, w2, tw, ti, plan=plan)[:n].float()
    delta, ref_delta = out - base, ref - ref_base
    return {"max_err": ((out - ref).abs().max() / ref.abs().max()).item(),
            "delta_rel_err": ((delta - ref_delta).norm() / ref_delta.norm()).item()}


def time_lora_cases(batch: int, weights, inputs, pools, bw: dict, pdl: bool, rounds: int = 2) -> dict:
    """Per LoRA case: MoE alone and MoE + LoRA (each with its default plan), interleaved `rounds` times
    (medians)."""
    plan, lora_plan = engine_plan(batch), engine_plan(batch, lora=True)
    out = {}
    for case in LORA_CASES:
        loras = [lora_args(pools, i, batch, case) for i in range(NUM_SETS)]
        base_times, lora_times = [], []
        for _ in range(rounds):
            base_times.append(time_moe(weights, inputs, plan=plan, pdl=pdl))
            lora_times.append(time_moe(weights, inputs, loras, plan=lora_plan, pdl=pdl))
        lora_bytes = lora_touched_bytes(loras[0], inputs[0][2])
        row = {"base_us": statistics.median(base_times), "us": statistics.median(lora_times),
               "lora_mb": lora_bytes / 1e6, "lora_floor_us": lora_bytes / bw["read_gbps"] / 1e3}
        row["ratio"] = row["us"] / row["base_us"]
        row.update(lora_errors(weights, inputs, loras[0], lora_plan, lora_reference(weights, inputs, loras[0])))
        out[case] = row
    return out


def _lora_variants(plan: MoEPlan) -> dict[str, MoEPlan]:
    """Around the default sorted plan: one knob at a time, then a few combinations (the expands run one way, in
    the GEMM epilogues on the plan's tiles: the LoRA's own knobs are its shrinks')."""
    gu, dn = plan.gate_up, plan.down
    v = {"default": plan}
    for bk in (64, 256):
        v[f"shrink_k{bk}"] = replace(plan, lora_shrink_block_k=bk)
    for gs, ds in ((2, 1), (8, 3), (8, 6), (16, 6)):
        v[f"splits{gs}/{ds}"] = replace(plan, lora_gate_up_splits=gs, lora_down_splits=ds)
    for lanes in (1, 2, 8):
        v[f"lanes{lanes}"] = replace(plan, lora_shrink_lanes=lanes)
    for warps in (2, 8):
        v[f"shrink_w{warps}"] = replace(plan, lora_shrink_warps=warps)
    v["lanes8_splits8/6_k64"] = replace(plan, lora_shrink_lanes=8, lora_gate_up_splits=8,
                                        lora_down_splits=6, lora_shrink_block_k=64)
    for stages in (1, 2, 4):
        v[f"shrink_st{stages}"] = replace(plan, lora_shrink_stages=stages)
    for gs, ds, stages in ((4, 2, 3), (4, 1, 3), (4, 2, 4), (8, 3, 2), (16, 6, 2)):
        v[f"splits{gs}/{ds}_st{stages}"] = replace(plan, lora_gate_up_splits=gs, lora_down_splits=ds,
                                                   lora_shrink_stages=stages)
    v["shrink_k256_w8"] = replace(plan, lora_shrink_block_k=256, lora_shrink_warps=8)
    v["splits4/2_k256_w8"] = replace(plan, lora_shrink_block_k=256, lora_shrink_warps=8, lora_gate_up_splits=4,
                                     lora_down_splits=2)
    v["base_n64"] = replace(plan, gate_up=replace(gu, block_n=64, num_stages=4),
                            down=replace(dn, block_n=64, num_stages=4))
    if gu.block_m == 16 and dn.block_n == 128:
        v["down_n256w8"] = replace(plan, down=replace(dn, block_n=256, block_k=64, num_warps=8))
    if gu.block_m > 16:
        v["m32"] = replace(plan, gate_up=GemmTile(32, 128, 64, 4, 4), down=GemmTile(32, 128, 64, 4, 4))
    return v


def sweep_lora(batch: int, weights, inputs, pools, pdl: bool, rounds: int = 2, only: str = "*") -> list[dict]:
    """4 rank-16 adapters, (MoE + LoRA) / MoE with the same base plan, over the sorted-path LoRA
    tiles (shrink K step, K splits, slot lanes, warps, base GEMM tiles); all variants timed in turn,
    `rounds` times (medians). Each also reports the relative error of its LoRA delta against the fp32
    reference (first 64 tokens). `only`: comma list of fnmatch patterns of the variant names to time
    ("default" is always timed)."""
    loras = [lora_args(pools, i, batch, "lora4_r16") for i in range(NUM_SETS)]
    if batch * TOP_K <= 64:
        return []  # decode path: no sorted-path LoRA kernels
    patterns = ["default", *only.split(",")]
    plans = {name: plan for name, plan in _lora_variants(engine_plan(batch, lora=True, decode=False)).items()
             if any(fnmatch.fnmatchcase(name, p) for p in patterns)}
    times = {name: ([], []) for name in plans}
    for _ in range(rounds):
        for name, plan in plans.items():
            _try_time(times[name][0], {}, weights, inputs, plan=plan, pdl=pdl)
            _try_time(times[name][1], {}, weights, inputs, loras, plan=plan, pdl=pdl)
    reference = lora_reference(weights, inputs, loras[0])
    rows = []
    for name, plan in plans.items():
        base, lora = times[name]
        if not (base and lora):
            continue
        row = {"variant": name, "base_us": statistics.median(r["us"] for r in base),
               "lora_us": statistics.median(r["us"] for r in lora)}
        row["ratio"] = row["lora_us"] / row["base_us"]
        row["delta_rel_err"] = lora_errors(weights, inputs, loras[0], plan, reference)["delta_rel_err"]
        rows.append(row)
    return rows


PROFILE_BATCHES = (8, 64, 256)


def _kernel_split(calls, forwards: int) -> list[tuple[str, float, float]]:
    """(kernel, launches per forward, us per forward) of `calls` under the profiler, in launch order of
    first appearance. A LoRA shrink is named after the GEMM it feeds (the next GEMM launched), so the
    gate_up and down shrinks are told apart."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        calls()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    names = [e.name for e in kernels]
    for i, name in enumerate(names):
        if "lora_block_shrink" in name:
            feeds = next((n for n in names[i + 1:] if "_moe_gate_up_kernel" in n or "_moe_down_kernel" in n), "?")
            names[i] = f"{name} -> {feeds}"
    split: dict[str, list[float]] = {}
    for name, e in zip(names, kernels):
        entry = split.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += e.time_range.end - e.time_range.start
    return [(name, n / forwards, us / forwards) for name, (n, us) in split.items()]


def profile(batch: int, weights, inputs, pools, pdl: bool) -> dict:
    """Per-kernel GPU time per forward of eager calls: MoE alone, then MoE + 4 rank-16 adapters
    under the LoRA call's default plan (each mode profiled on its own, so the LoRA GEMMs are not
    averaged with the base ones)."""
    loras = [lora_args(pools, i, batch, "lora4_r16") for i in range(NUM_SETS)]
    plan, lora_plan = engine_plan(batch), engine_plan(batch, lora=True)
    modes = {"moe": (None, plan), "lora4 default": (loras, lora_plan)}
    rounds = 5
    out = {}
    for mode, (lora, mode_plan) in modes.items():
        time_moe(weights, inputs, lora, plan=mode_plan, pdl=pdl)  # compile and warm up

        def calls(lora=lora, mode_plan=mode_plan):
            for _ in range(rounds):
                for i, ((w13, w2), (x, tw, ti)) in enumerate(zip(weights, inputs)):
                    fused_moe(x, w13, w2, tw, ti, lora[i] if lora else None, plan=mode_plan, pdl=pdl)

        out[mode] = _kernel_split(calls, rounds * NUM_SETS)
    return out


def profile_table(batch: int, split: dict) -> str:
    lines = [f"per-kernel us per forward (batch {batch}, eager, 5 rounds x {NUM_SETS} sets):"]
    for mode, rows in split.items():
        lines.append(f"  {mode}: total {sum(us for _, _, us in rows):.1f} us")
        lines += [f"    {us:>8.1f} us  {n:>4.1f}x  {name[:90]}" for name, n, us in rows]
    return "\n".join(lines)


def bench_batch(batch: int, args, gen, weights, pools, bw: dict, report: dict) -> None:
    inputs = [make_inputs(batch, gen) for _ in range(NUM_SETS)]
    plan = engine_plan(batch)
    moe_us = time_moe(weights, inputs, pdl=args.pdl)
    gbps = touched_bytes(batch) / moe_us / 1e3
    row = {"batch": batch, "path": "decode" if plan.decode else "sorted",
           "plan": asdict(plan), "moe_us": moe_us, "touched_gb": touched_bytes(batch) / 1e9,
           "gbps": gbps, "frac_read_bw": gbps / bw["read_gbps"],
           "unique_experts": statistics.mean(
               ti.unique().numel() for _, _, ti in inputs)}
    row.update(time_lora_cases(batch, weights, inputs, pools, bw, args.pdl))
    block_m = plan.gate_up.block_m
    row["align_us"] = graph_time_us(
        [lambda ti=ti: moe_align(ti, NUM_EXPERTS, block_m) for _, _, ti in inputs])
    row["align_ref_us"] = graph_time_us(
        [lambda ti=ti: moe_align_ref(ti, NUM_EXPERTS, block_m) for _, _, ti in inputs])
    report["batches"].append(row)
    print(f"batch {batch}: {row['path']} {moe_us:.1f} us, {gbps:.0f} GB/s "
          f"({100 * row['frac_read_bw']:.0f}% of read), lora4 x{row['lora4_r16']['ratio']:.3f}",
          flush=True)
    if args.sweep:
        rows = sweep(batch, weights, inputs, args.pdl)
        report["sweep"][batch] = rows
        best = min(rows, key=lambda r: r["us"])
        print(f"  sweep best: {_tile_label(best)} {best['us']:.1f} us  | "
              + " ".join(f"{_tile_label(r)}={r['us']:.0f}" for r in rows), flush=True)
    if args.sweep or args.lora_sweep:
        lora_rows = sweep_lora(batch, weights, inputs, pools, args.pdl, only=args.lora_variants)
        report["sweep_lora"][batch] = lora_rows
        print("  lora4 sweep: " + "  ".join(
            f"{r['variant']} {r['base_us']:.0f}->{r['lora_us']:.0f} us x{r['ratio']:.3f}"
            for r in lora_rows), flush=True)
    if args.profile and batch in PROFILE_BATCHES:
        split = profile(batch, weights, inputs, pools, args.pdl)
        report["profile"][batch] = {mode: [{"kernel": k, "per_forward": n, "us": us} for k, n, us in rows]
                                    for mode, rows in split.items()}
        print(profile_table(batch, split), flush=True)


ROUTER_BATCHES = (1, 8, 64, 256, 512)
ROUTER_SETS = 160  # router weights per timed graph: 160 x 512 KB = 80 MB > L2, as between layers
ROUTER_TILES = [RouterTile(block_t=1, block_e=2, block_h=2048, num_warps=4),
                RouterTile(block_t=1, block_e=2, block_h=2048, num_warps=2),  # a shorter routing tail (fewer warps)
                RouterTile(block_t=1, block_e=4, block_h=1024, num_warps=4),
                RouterTile(block_t=1, block_e=8, block_h=512, num_warps=4),
                RouterTile(block_t=1, block_e=8, block_h=512, num_warps=2),
                RouterTile(block_t=1, block_e=8, block_h=256, num_warps=4),
                RouterTile(block_t=2, block_e=8, block_h=512, num_warps=8),
                RouterTile(block_t=4, block_e=8, block_h=512, num_warps=8),
                RouterTile(block_t=4, block_e=16, block_h=128, num_warps=8)]


def _tile_name(t: RouterTile) -> str:
    return f"t{t.block_t}e{t.block_e}h{t.block_h}w{t.num_warps}"


def bench_router(gen) -> dict:
    """µs per routing of one layer (median of graph replays) and rows whose experts differ from torch's."""
    weights = [torch.randn(NUM_EXPERTS, HIDDEN, generator=gen, device=DEVICE, dtype=torch.bfloat16) * 0.02
               for _ in range(ROUTER_SETS)]
    rows = []
    for batch in ROUTER_BATCHES:
        xs = [torch.randn(batch, HIDDEN, generator=gen, device=DEVICE, dtype=torch.bfloat16)
              for _ in range(ROUTER_SETS)]
        counters = torch.zeros(counter_slots(batch), dtype=torch.int32, device=DEVICE)

        def torch_route(x, w):
            return fused_topk_ref(torch.nn.functional.linear(x, w), TOP_K, True, x.dtype)

        variants = {"torch": torch_route,
                    "linear+fused_topk": lambda x, w: fused_topk(torch.nn.functional.linear(x, w), TOP_K, True,
                                                                 x.dtype),
                    "linear+fused_topk:3red": lambda x, w: fused_topk(torch.nn.functional.linear(x, w), TOP_K, True,
                                                                      x.dtype, packed_topk=False)}
        variants["gemm_topk:default"] = (
            lambda x, w: fused_gemm_topk(x, w, TOP_K, True, x.dtype, counters=counters))
        variants["gemm_topk:default:3red"] = (
            lambda x, w: fused_gemm_topk(x, w, TOP_K, True, x.dtype, counters=counters, packed_topk=False))
        for tile in ROUTER_TILES:
            variants["gemm_topk:" + _tile_name(tile)] = (
                lambda x, w, tile=tile: fused_gemm_topk(x, w, TOP_K, True, x.dtype, counters=counters, tile=tile))
            if tile.num_warps == 2:  # does the routing tail's selection matter more or less with fewer warps?
                variants["gemm_topk:" + _tile_name(tile) + ":3red"] = (
                    lambda x, w, tile=tile: fused_gemm_topk(x, w, TOP_K, True, x.dtype, counters=counters,
                                                            tile=tile, packed_topk=False))
        row = {"batch": batch, "us": {}, "rows_differing": {}}
        ref_ids = torch_route(xs[0], weights[0])[1].sort(-1).values
        for name, fn in variants.items():
            try:
                ids = fn(xs[0], weights[0])[1].long().sort(-1).values
                row["rows_differing"][name] = int((ids != ref_ids).any(-1).sum())
                row["us"][name] = graph_time_us([lambda x=x, w=w, fn=fn: fn(x, w) for x, w in zip(xs, weights)])
            except Exception as exc:  # a tile that does not compile is reported, not fatal
                print(f"  router {name} at T={batch} failed: {exc!r}"[:300], flush=True)
        rows.append(row)
        print(f"router T={batch}: " + "  ".join(f"{k} {v:.1f}" for k, v in row["us"].items()), flush=True)
    names = list(dict.fromkeys(k for r in rows for k in r["us"]))
    print(f"\nrouter (H {HIDDEN}, E {NUM_EXPERTS}, top-{TOP_K}, renorm, bf16): us per layer, graph replays over "
          f"{ROUTER_SETS} router weights; fused GEMM used at T <= {GEMM_TOPK_MAX_TOKENS}; "
          "(n) = rows whose experts differ from torch's (bf16 near-ties)")
    print(f"{'T':>4} " + " ".join(f"{n[:26]:>26}" for n in names))
    for r in rows:
        print(f"{r['batch']:>4} " + " ".join(
            f"{r['us'][n]:>20.1f} ({r['rows_differing'][n]:>3})" if n in r["us"] else f"{'-':>26}" for n in names))
    return {"shape": dict(hidden=HIDDEN, experts=NUM_EXPERTS, top_k=TOP_K), "sets": ROUTER_SETS,
            "gemm_topk_max_tokens": GEMM_TOPK_MAX_TOKENS, "rows": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels.kernels", description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,32,64,128,256,512")
    ap.add_argument("--out", default="bench_out/")
    ap.add_argument("--sweep", action="store_true", help="also time block-size candidates")
    ap.add_argument("--lora-sweep", action="store_true",
                    help="time sorted-path MoE-LoRA tile candidates, 4 rank-16 adapters")
    ap.add_argument("--lora-variants", default="*",
                    help="comma list of fnmatch patterns: the --lora-sweep variants to time (e.g. 'splits*'); "
                         "the default plan is always timed")
    ap.add_argument("--profile", action="store_true", help="per-kernel times at a few batches")
    ap.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=None,
                    help="moe part: launch with programmatic dependent launch, as the engine does (default: where "
                         "the GPU has it); with it a LoRA shrink runs under the GEMM that expands it")
    ap.add_argument("--tune", action="store_true",
                    help="tune the sorted-path MoE tiles for this GPU (moe_tune.py) and write the tile table; "
                         "--shape E,H,I,K and --dtype pick the problem, --batches the token counts")
    ap.add_argument("--shape", default=None, help="--tune: experts,hidden,inter,top_k (default: Qwen3-30B-A3B's)")
    ap.add_argument("--dtype", default="bfloat16", help="--tune: the weights' dtype")
    known = {"moe", "router", "dense_lora", "norm_rotary", "gemv"}
    ap.add_argument("--parts", default="moe,router,dense_lora,norm_rotary",
                    help="comma list: moe (fused MoE and MoE-LoRA), router (routing), dense_lora (one- vs two-launch "
                         "dense LoRA), norm_rotary (fused norms, attention prologue), gemv (Triton GEMV vs cuBLAS "
                         "at T <= 8, with the LoRA expand fused)")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    if not parts <= known:
        ap.error(f"--parts: unknown part(s) {sorted(parts - known)}; choose from {', '.join(sorted(known))}")
    if not torch.cuda.is_available():
        print("the kernel benchmarks need a CUDA device")
        return 1
    if args.pdl is None:
        args.pdl = pdl_supported(torch.device(DEVICE))
    batches = [int(b) for b in args.batches.split(",")]
    if args.tune:
        from benchmarks.kernels import moe_tune

        shape = tuple(int(v) for v in args.shape.split(",")) if args.shape else (NUM_EXPERTS, HIDDEN, INTER, TOP_K)
        tune_batches = batches if args.batches != ap.get_default("batches") else moe_tune.BATCHES
        moe_tune.run(shape, args.dtype, tune_batches, args.out, args.pdl)
        return 0
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    gen = torch.Generator(DEVICE).manual_seed(0)
    device = torch.cuda.get_device_name()
    if "norm_rotary" in parts:
        run_norm_rotary(out_dir)
    if "router" in parts:
        router = bench_router(gen)
        (out_dir / "router_bench.json").write_text(json.dumps({"device": device, **router}, indent=1))
    if not parts & {"moe", "dense_lora", "gemv"}:
        return 0
    bw = read_bandwidth()
    print(f"{device}: copy {bw['copy_gbps']:.0f} GB/s (read+write), "
          f"read-only sum {bw['read_gbps']:.0f} GB/s", flush=True)
    if "gemv" in parts:
        run_gemv(out_dir, args.sweep, gen, device, bw)
    if not parts & {"moe", "dense_lora"}:
        return 0
    report = {"device": device, "shape": dict(hidden=HIDDEN, inter=INTER, experts=NUM_EXPERTS,
                                              top_k=TOP_K),
              "bandwidth": bw, "batches": [], "sweep": {}, "sweep_lora": {},
              "profile": {}, "dense_lora": [], "pdl": args.pdl}

    def save():
        (out_dir / "kernels_bench.json").write_text(json.dumps(report, indent=1))

    if "dense_lora" in parts:
        dense_lora.run(batches, args.sweep, gen, report["dense_lora"], save)
        dense_lora.print_table(report["dense_lora"])
    if "moe" not in parts:
        return 0
    weights = [make_weights(gen) for _ in range(NUM_SETS)]
    pools = {r: [make_lora_pool(gen, r) for _ in range(NUM_SETS)] for r in POOL_RANKS}

    for batch in batches:
        try:
            bench_batch(batch, args, gen, weights, pools, bw, report)
        except Exception:
            traceback.print_exc()
        save()


    print(f"\nfused MoE at Qwen3-30B-A3B shapes, {device}, read bandwidth "
          f"{bw['read_gbps']:.0f} GB/s (copy {bw['copy_gbps']:.0f} GB/s r+w); "
          f"PDL {'on' if args.pdl else 'off'}; LoRA columns = (MoE + LoRA) / MoE; {time.time() - t0:.0f} s")
    head = (f"{'batch':>5} {'path':>6} {'moe us':>8} {'GB':>6} {'GB/s':>6} {'%read':>5} "
            + " ".join(f"{c:>14}" for c in LORA_CASES) + f" {'align us':>8} {'torch':>6}")
    print(head)
    for r in report["batches"]:
        print(f"{r['batch']:>5} {r['path']:>6} {r['moe_us']:>8.1f} {r['touched_gb']:>6.2f} "
              f"{r['gbps']:>6.0f} {100 * r['frac_read_bw']:>5.0f} "
              + " ".join(f"{r[c]['ratio']:>14.3f}" for c in LORA_CASES)
              + f" {r['align_us']:>8.1f} {r['align_ref_us']:>6.1f}")
    print_lora_table(report["batches"])
    print_lora_sweep_tables(report["sweep_lora"], report["profile"])
    save()
    return 0


def print_lora_sweep_tables(sweep_rows: dict, profiles: dict) -> None:
    """The sorted-path LoRA plan variants against the default (from --lora-sweep), one row a variant, and the
    split of a forward between shrinks and GEMMs (from --profile)."""
    by_batch = {batch: {r["variant"]: r for r in rows} for batch, rows in sweep_rows.items()}
    by_batch = {batch: rows for batch, rows in by_batch.items() if "default" in rows}
    if by_batch:
        print("\nMoE-LoRA plan variants, 4 rank-16 adapters: (MoE + LoRA) / MoE [LoRA us / default's], "
              "d = rel. error of the LoRA delta")
        print(f"{'variant':>22} " + " ".join(f"{'T=' + str(batch):>24}" for batch in by_batch))
        for n in dict.fromkeys(n for rows in by_batch.values() for n in rows):
            cells = []
            for rows in by_batch.values():
                r, ref = rows.get(n), rows["default"]["lora_us"]
                cells.append(f"{r['ratio']:.3f} [{r['lora_us'] / ref:.3f}] d{r.get('delta_rel_err', float('nan')):.0e}"
                             if r else "-")  # not asked for (--lora-variants), or failed (printed above)
            print(f"{n:>22} " + " ".join(f"{c:>24}" for c in cells))
    if profiles:
        print("\nMoE forward split (us per forward, eager): shrinks, gate_up GEMM, down GEMM, the rest")
        print(f"{'batch':>5} {'mode':>28} {'total':>7} {'shrinks':>8} {'gate_up':>8} {'down':>8} {'rest':>7}")
        for batch, modes in profiles.items():
            for mode, rows in modes.items():
                total = sum(r["us"] for r in rows)
                shrink = sum(r["us"] for r in rows if "shrink" in r["kernel"])
                gate_up = sum(r["us"] for r in rows if "gate_up_kernel" in r["kernel"] and "shrink" not in r["kernel"])
                down = sum(r["us"] for r in rows if "down_kernel" in r["kernel"] and "shrink" not in r["kernel"])
                print(f"{batch:>5} {mode:>28} {total:>7.1f} {shrink:>8.1f} {gate_up:>8.1f} {down:>8.1f} "
                      f"{total - shrink - gate_up - down:>7.1f}")


def print_lora_table(rows: list[dict]) -> None:
    """MoE-LoRA per batch and case: us and (MoE + LoRA) / MoE, the adapter bytes touched and their
    time at read bandwidth, errors against the fp32 reference."""
    print("\nMoE-LoRA (every token has an adapter; #12 target: lora4_r16 <= 1.15 x MoE at T 64-512): "
          "us (x MoE alone), adapter MB touched and their us at read bandwidth, "
          "err = max|out-ref|/max|ref|, d = rel. error of the LoRA delta")
    print(f"{'T':>4} {'path':>6} {'case':>15} {'moe us':>7} {'MB':>6} {'floor':>6} {'moe + lora':>34}")
    for r in rows:
        for c in LORA_CASES:
            row = r[c]
            cell = (f"{row['us']:>7.1f} (x{row['ratio']:.3f}) err {row['max_err']:.1e} "
                    f"d {row['delta_rel_err']:.0e}")
            print(f"{r['batch']:>4} {r['path']:>6} {c:>15} {row['base_us']:>7.1f} {row['lora_mb']:>6.1f} "
                  f"{row['lora_floor_us']:>6.1f} {cell:>34}")


def run_gemv(out_dir: Path, sweep: bool, gen, device: str, bw: dict) -> None:
    from benchmarks.kernels import gemv

    rows: list[dict] = []

    def save():
        (out_dir / "gemv_bench.json").write_text(json.dumps({"device": device, "bandwidth": bw, "rows": rows},
                                                            indent=1))

    gemv.run(sweep, gen, rows, save, bw["read_gbps"])
    gemv.print_table(rows, bw["read_gbps"])


def run_norm_rotary(out_dir: Path) -> None:
    from benchmarks.kernels import norm_kernels

    rows = norm_kernels.bench_norm_rotary()
    (out_dir / "norm_rotary_bench.json").write_text(
        json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    norm_kernels.print_table(rows)


if __name__ == "__main__":
    raise SystemExit(main())
