"""FP8 routed experts (kernels/fused_moe_fp8.py) against the bf16 fused MoE, and the dense FP8 linear
(kernels/fp8_linear.py) against bf16 cuBLAS, at Qwen3-30B-A3B shapes (128 experts, H 2048, I 768, top-8).

    python -m benchmarks.kernels.fp8_moe --out DIR [--tokens 1,8,...] [--sweep] [--parts moe,dense]
    python benchmarks/kernels/fp8_moe.py --out DIR         (the same, from the repository root)

moe, per token count T: µs per call of bf16 fused_moe, FP8 weight-only and FP8 W8A8 (fused_moe_fp8) at their
default plans (the GEMV path at T <= 8, as bf16 chooses it), and at T <= 8 also of the three forced onto the
sorted path (`*_sorted`); each as a CUDA-graph replay that rotates through NUM_SETS copies of
weights and inputs (each far larger than L2, as when 48 layers run between two calls of one layer), timed
interleaved (A, B, A, B) and reported as medians. Before timing, each FP8 variant is checked against the bf16
kernel on the bf16-rounded dequantized weights (relative error printed; W8A8 sits a few percent off by design).
`fp8_wp`: weight-only with each K step's product scaled instead of the weight tile (weight_scale="product"), on
the sorted path. `--sweep`: FP8 tile candidates per T (gate_up and down alike; sorted tiles, and GEMV tiles at
T <= 8; weight-only in both scalings, `_p` the product one), the best printed next to the default, and the best
sorted tiles of each multiplication written as tile-table entries (DIR/moe_tiles_fp8.json, the format of
moeserve/kernels/moe_tiles.json, dtype "fp8_w8a8" / "fp8_w": merge them there, or point MOESERVE_MOE_TILES at the
file). `fp8_auto`: what the engine runs (act_quant=None: W8A8 on the sorted path, weight-only on the GEMV path).
dense: µs of the q|k|v (2048 -> 5120) and o (4096 -> 2048) projections: bf16 F.linear, FP8 Triton weight-only
(both scalings) and W8A8, and torch._scaled_mm with block scales (W8A8); `--sweep`: Triton tiles.
Prints tables; writes DIR/fp8_moe_bench.json (after every T, so a run cut short keeps what it measured).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root on the path, as `python -m` would have it
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from moeserve.bench.common import bandwidths, graph_time_us  # noqa: E402
from moeserve.kernels.fp8 import FP8_DTYPE, dequantize_block_fp8, quantize_block_fp8  # noqa: E402
from moeserve.kernels.fp8_linear import (  # noqa: E402
    GEMV_MAX_ROWS,
    GemvTile,
    fp8_linear,
    split_counter_slots,
    split_counters,
)
from moeserve.kernels.fused_moe import fused_moe  # noqa: E402
from moeserve.kernels.fused_moe_fp8 import (  # noqa: E402
    FP8_DECODE_MAX_PAIRS,
    MAX_W8A8_TILE,
    dequantize_w13_fp8,
    fp8_plan,
    fused_moe_fp8,
    quantize_w13_fp8,
)
from moeserve.kernels.moe_plan import (  # noqa: E402
    DECODE_MAX_PAIRS,
    GemmTile,
    MoEPlan,
    TABLE_PATH,
    MoEProblem,
    fit_tile,
    smem_limit,
)
from moeserve.kernels.pdl import supported as pdl_supported  # noqa: E402

HIDDEN, INTER, NUM_EXPERTS, TOP_K = 2048, 768, 128, 8
DEVICE = "cuda"
NUM_SETS = 4  # weight/input sets one timed graph rotates through (bf16 1.2 GB, fp8 0.6 GB each: >> L2)
TOKENS = "1,8,64,256,512,2048,8192"
ROUNDS = 2  # interleaved rounds per variant; the median is reported
DENSE_SHAPES = {"qkv": (5120, 2048), "o": (2048, 4096)}  # name -> (out, in)
DENSE_SETS = 16  # dense weights are 10-20 MB: more copies to keep them out of L2
DENSE_SWEEP_TILES = [  # (block_m, block_n, block_k, num_warps, num_stages) of fp8_linear's Triton GEMM
    (16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (32, 64, 128, 4, 4), (64, 128, 128, 4, 3),
    (64, 128, 64, 4, 4), (128, 128, 128, 8, 3), (128, 256, 64, 8, 3),
    # narrower column tiles: more programs at decode sizes (16 x 32 beat 16 x 64 at 1-2 rows, session 21)
    (16, 16, 128, 4, 4), (16, 32, 128, 4, 6), (32, 32, 128, 4, 4), (64, 32, 128, 4, 4), (64, 64, 128, 4, 4),
    (128, 64, 128, 4, 3),
]
SWEEP_TILES = [  # (block_m, block_n, block_k, num_warps, num_stages[, group_m]); each also with weights by TMA
    (16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (32, 128, 128, 4, 3), (64, 128, 128, 4, 3),
    (64, 128, 128, 4, 4), (64, 128, 128, 4, 3, 8), (64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (64, 256, 128, 8, 3),
    (128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 64, 128, 4, 4), (128, 256, 128, 8, 3), (128, 256, 64, 8, 4),
]
GEMV_SWEEP_TILES = [  # (block_n, block_k, num_warps, num_stages), GEMV path at T <= 8 (default 16 x 512 / 32 x 256)
    (16, 128, 4, 1), (16, 256, 4, 1), (16, 512, 4, 1), (32, 256, 4, 1), (32, 512, 4, 1), (64, 256, 4, 1),
    (16, 1024, 4, 1), (16, 512, 8, 1), (32, 512, 8, 1),
    # twice the bytes a program has in flight (an fp8 tile of bf16's elements holds half its bytes), and pipelined
    (16, 256, 4, 2), (16, 512, 4, 2), (32, 256, 4, 2), (8, 512, 4, 1), (8, 1024, 4, 1), (32, 1024, 8, 1),
    (16, 2048, 8, 1), (64, 512, 8, 1),
]
# split-K: (block_m, block_n, block_k, num_warps, num_stages, split_k); the K walk shared by split_k programs
DENSE_SPLIT_TILES = [(bm, bn, 128, 4, 4, sk) for bm, bn in ((16, 32), (16, 64), (32, 64), (64, 64), (64, 32))
                     for sk in (2, 4, 8)] + [(64, 128, 128, 4, 3, sk) for sk in (2, 4)]
DENSE_GEMV_SWEEP = [  # fp8_linear's GEMV at 1-2 rows: (block_n, block_k, num_warps, num_stages); default 4 x 1024 w4 s2
    (4, 1024, 4, 2), (4, 1024, 4, 1), (4, 1024, 4, 3), (4, 2048, 4, 1), (4, 2048, 8, 1), (8, 1024, 4, 1),
    (8, 1024, 4, 2), (8, 1024, 8, 2), (8, 2048, 8, 1), (16, 512, 4, 2), (16, 1024, 8, 1), (2, 2048, 4, 1),
]


def touched_bytes(batch: int, elt_bytes: float) -> float:
    """Expected expert weight bytes a call reads (experts hit by `batch` tokens at uniform routing)."""
    expected_experts = NUM_EXPERTS * (1 - (1 - TOP_K / NUM_EXPERTS) ** batch)
    return expected_experts * 3 * HIDDEN * INTER * elt_bytes


def make_weights(gen):
    """(bf16 w13, bf16 w2, fp8 w13, its scales, fp8 w2, its scales), the bf16 pair the dequantized fp8 one (so the
    check below compares the kernels, not the quantization)."""
    w13 = torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen, device=DEVICE, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen, device=DEVICE, dtype=torch.bfloat16) * 0.02
    q13, s13 = quantize_w13_fp8(w13)
    q2, s2 = quantize_block_fp8(w2)
    del w13, w2
    return (dequantize_w13_fp8(q13, s13, dtype=torch.bfloat16), dequantize_block_fp8(q2, s2, dtype=torch.bfloat16),
            q13, s13, q2, s2)


def make_inputs(batch: int, gen):
    x = torch.randn(batch, HIDDEN, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    logits = torch.randn(batch, NUM_EXPERTS, generator=gen, device=DEVICE)
    weights, ids = torch.softmax(logits, -1).topk(TOP_K, -1)
    return x, weights, ids.to(torch.int32)


def _rel(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def moe_variants(batch: int, pdl: bool) -> dict:
    """name -> fn(weights, inputs) of one call."""
    def bf16(w, i, decode=None):
        return fused_moe(i[0], w[0], w[1], i[1], i[2], decode=decode, pdl=pdl)

    def fp8(w, i, act_quant, decode=None, weight_scale="tile"):
        return fused_moe_fp8(i[0], *w[2:], i[1], i[2], act_quant=act_quant, decode=decode, pdl=pdl,
                             weight_scale=weight_scale)

    variants = {"bf16": bf16,
                "fp8_auto": lambda w, i: fp8(w, i, None),  # what the engine runs: W8A8 sorted, weight-only GEMV
                "fp8_w": lambda w, i: fp8(w, i, False),
                "fp8_w8a8": lambda w, i: fp8(w, i, True),
                # weight-only with each K step's product scaled instead of the weight tile (sorted path only)
                "fp8_wp": lambda w, i: fp8(w, i, False, decode=False, weight_scale="product")}
    if batch * TOP_K <= FP8_DECODE_MAX_PAIRS:  # the defaults are the GEMV paths: the sorted ones beside them
        variants.update(bf16_sorted=lambda w, i: bf16(w, i, decode=False),
                        fp8_w_sorted=lambda w, i: fp8(w, i, False, decode=False),
                        fp8_w8a8_sorted=lambda w, i: fp8(w, i, True, decode=False))
    return variants


def time_interleaved(fn_sets: dict, rounds: int = ROUNDS) -> dict:
    """name -> median µs over `rounds` interleaved graph timings (A, B, A, B); a variant that fails records its
    error instead."""
    times = {name: [] for name in fn_sets}
    errors = {}
    for _ in range(rounds):
        for name, fns in fn_sets.items():
            if name in errors:
                continue
            try:
                times[name].append(graph_time_us(fns))
            except Exception as exc:  # one failing variant (a tile that does not compile) keeps the rest
                traceback.print_exc()
                errors[name] = f"{type(exc).__name__}: {exc}"[:300]
    return {name: (statistics.median(t) if t else errors[name]) for name, t in times.items()}


def time_plans(plans: dict, weights, inputs, loras, rounds: int = ROUNDS) -> dict:
    """(name, with LoRA) -> median µs (or the error) of the W8A8 fused_moe_fp8 on each of `plans`, without and with
    `loras` (one per weight set), all timed interleaved; `weights` the fp8 (w13, s13, w2, s2) sets, `inputs` the
    (x, topk weights, topk ids) sets."""
    def fns(plan, with_lora):
        return [lambda w=w, inp=inp, lo=lo: fused_moe_fp8(inp[0], *w, inp[1], inp[2], act_quant=True, plan=plan,
                                                          pdl=True, lora=lo if with_lora else None)
                for w, inp, lo in zip(weights, inputs, loras)]

    return time_interleaved({(name, lo): fns(plan, lo) for name, plan in plans.items() for lo in (False, True)}, rounds)


def table_with_w8a8_rows(rows: dict, fields, path, options=()) -> None:
    """The shipped tile table (moe_plan.TABLE_PATH) with the W8A8 rows of the token counts in `rows` (max_tokens ->
    MoEPlan) given those plans' `fields` ("gate_up", "down": their tiles) and boolean `options` (plan fields a
    table row may set, moe_plan.PLAN_OPTIONS), written to `path`."""
    table = json.loads(TABLE_PATH.read_text())
    for entry in table["entries"]:
        if entry["dtype"] == "fp8_w8a8":
            for row in entry["tiles"]:
                plan = rows.get(row["max_tokens"])
                if plan is not None:
                    row.update({f: getattr(plan, f).as_list() for f in fields})
                    row.update({o: bool(getattr(plan, o)) for o in options})
    Path(path).write_text(json.dumps(table, indent=1))


def w8a8_sweep_sets(gen) -> tuple[list, dict, MoEProblem]:
    """What a W8A8 plan sweep times on (benchmarks/session2x/*_tiles.py): NUM_SETS fp8 (w13, s13, w2, s2) weight
    sets, rank-16 LoRA pools for them, and the problem at these shapes."""
    from benchmarks.kernels.kernels import make_lora_pool

    weights = [make_weights(gen)[2:] for _ in range(NUM_SETS)]  # the fp8 weights and scales only
    pools = {16: [make_lora_pool(gen, 16) for _ in range(NUM_SETS)]}
    return weights, pools, MoEProblem(NUM_EXPERTS, HIDDEN, INTER, TOP_K, torch.bfloat16, torch.device(DEVICE))


def w8a8_sweep_inputs(tokens: int, gen, pools) -> tuple[list, list]:
    """(inputs, loras) of `tokens` tokens for each weight set: 4 rank-16 adapters over every token."""
    from benchmarks.kernels.kernels import lora_args

    return ([make_inputs(tokens, gen) for _ in range(NUM_SETS)],
            [lora_args(pools, i, tokens, "lora4_r16") for i in range(NUM_SETS)])


def check_moe(weights, inputs, variants) -> dict:
    """Relative error of each FP8 variant against the bf16 kernel on the same (dequantized) weights; a variant
    that fails records its error (and is then not timed)."""
    ref = variants["bf16"](weights, inputs)
    errors = {}
    for name, fn in variants.items():
        if name.startswith("fp8"):
            try:
                errors[name] = _rel(fn(weights, inputs), ref)
            except Exception as exc:
                traceback.print_exc()
                errors[name] = f"{type(exc).__name__}: {exc}"[:300]
    return errors


def sweep_plans(batch: int, act_quant: bool) -> dict[str, MoEPlan]:
    limit = smem_limit(torch.device(DEVICE))
    a_bytes = 1 if act_quant else 2
    plans = {}
    for bm, bn, bk, warps, stages, *group in SWEEP_TILES:
        if bm > 16 and batch * TOP_K < 4 * NUM_EXPERTS:  # few pairs per expert: long blocks are mostly padding
            continue
        group_m = group[0] if group else 1
        tile = GemmTile(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, group_m=group_m)
        gate_up = fit_tile(tile, a_bytes, 1, limit)
        down = fit_tile(tile, a_bytes, 1 if act_quant else 2, limit)
        for fused_act in ((False,) if act_quant else (True, False)):
            for tma in (False, True):
                plan = MoEPlan(False, gate_up, down, y_fp32=False, fused_act=fused_act, weights_tma=tma)
                plans[f"{bm}x{bn}x{bk}w{warps}s{stages}{f'g{group_m}' if group_m > 1 else ''}"
                      f"{'' if fused_act else '_act'}{'_tma' if tma else ''}"] = plan
    if batch * TOP_K <= DECODE_MAX_PAIRS:
        for bn, bk, warps, stages in GEMV_SWEEP_TILES:
            tile = GemmTile(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
            plans[f"gemv_{bn}x{bk}w{warps}s{stages}"] = MoEPlan(True, tile, tile)
    return plans


# (block_n, block_k, num_warps, num_stages, group_m) the per-part tuning walks for each block_m, gate_up and down
# alike (down is K = 768: six 128-column steps, so shallow pipelines and more programs a wave are in the list)
TUNE_TILES = [(128, 128, 4, 3, 1), (64, 128, 4, 3, 1), (64, 128, 4, 4, 1), (128, 128, 4, 4, 1), (128, 128, 4, 2, 1),
              (128, 128, 8, 3, 1), (256, 128, 8, 3, 1), (256, 128, 4, 3, 1), (128, 64, 4, 4, 1), (128, 64, 4, 6, 1),
              (64, 64, 4, 6, 1), (256, 64, 8, 4, 1), (128, 128, 4, 3, 8), (64, 128, 2, 3, 1), (32, 128, 4, 4, 1)]


def _w8a8_tile(block_m: int, cand: tuple, limit: int) -> GemmTile:
    bn, bk, warps, stages, group_m = cand
    bn = min(bn, max(64, MAX_W8A8_TILE // block_m))  # as fp8_plan fits W8A8 tiles
    return fit_tile(GemmTile(block_m, bn, bk, warps, stages, group_m), 1, 1, limit)


def tune_w8a8(batch: int, gen, weights, pdl: bool) -> dict:
    """The W8A8 sorted path's gate_up and down tiles tuned apart (the --sweep ties them): for each block_m, the
    down tiles with the engine's gate_up tile, then the gate_up tiles with the best down; each block_m's best, the
    engine's plan and the best with weights by TMA switched, timed again interleaved (3 rounds, medians)."""
    limit = smem_limit(torch.device(DEVICE))
    inputs = [make_inputs(batch, gen) for _ in weights]
    problem = MoEProblem(NUM_EXPERTS, HIDDEN, INTER, TOP_K, torch.bfloat16, torch.device(DEVICE))
    engine = fp8_plan(batch, TOP_K, problem, True, decode=False)

    def fns(plan):
        return [lambda w=w, i=i: fused_moe_fp8(i[0], *w[2:], i[1], i[2], act_quant=True, plan=plan, pdl=pdl)
                for w, i in zip(weights, inputs)]

    def time_plan(plan):
        return time_interleaved({"p": fns(plan)}, rounds=1)["p"]

    pairs = batch * TOP_K
    block_ms = [16, 32] if pairs <= 512 else [16, 32, 64] if pairs <= 4096 else [64, 128]
    tma = engine.weights_tma
    tried, best_by_m, best_us = [], {}, {}
    for bm in block_ms:
        gu = _w8a8_tile(bm, (engine.gate_up.block_n, engine.gate_up.block_k, engine.gate_up.num_warps,
                             engine.gate_up.num_stages, engine.gate_up.group_m), limit)
        best, best_t = None, None
        for part in ("down", "gate_up"):
            for cand in TUNE_TILES:
                tile = _w8a8_tile(bm, cand, limit)
                plan = (MoEPlan(False, gu, tile, weights_tma=tma) if part == "down"
                        else MoEPlan(False, tile, best.down, weights_tma=tma))
                t = time_plan(plan)
                tried.append({"gate_up": plan.gate_up.as_list(), "down": plan.down.as_list(),
                              "us": t if isinstance(t, float) else None})
                if isinstance(t, float) and (best_t is None or t < best_t):
                    best, best_t = plan, t
            if best is None:
                break
        if best is not None:
            best_by_m[bm], best_us[bm] = best, best_t
    finalists = {"engine": engine, **{f"m{m}": p for m, p in best_by_m.items()}}
    if best_by_m:
        top = best_by_m[min(best_us, key=best_us.get)]
        finalists["tma_switched"] = replace(top, weights_tma=not top.weights_tma)
    medians = time_interleaved({name: fns(plan) for name, plan in finalists.items()}, rounds=3)
    ok = {n: v for n, v in medians.items() if isinstance(v, float)}
    best_name = min(ok, key=ok.get)
    plan = finalists[best_name]
    return {"tokens": batch, "best": best_name, "us": ok[best_name], "engine_us": ok.get("engine"),
            "finalists_us": medians, "gate_up": plan.gate_up.as_list(), "down": plan.down.as_list(),
            "weights_tma": plan.weights_tma, "engine_gate_up": engine.gate_up.as_list(),
            "engine_down": engine.down.as_list(), "candidates": tried}


def bench_moe_batch(batch: int, gen, weights, pdl: bool, sweep: tuple[str, ...]) -> dict:
    inputs = [make_inputs(batch, gen) for _ in weights]
    variants = moe_variants(batch, pdl)
    row = {"tokens": batch, "check_rel_err": check_moe(weights[0], inputs[0], variants)}
    fn_sets = {name: [lambda w=w, i=i, fn=fn: fn(w, i) for w, i in zip(weights, inputs)]
               for name, fn in variants.items() if not isinstance(row["check_rel_err"].get(name), str)}
    row["us"] = time_interleaved(fn_sets)
    problem = MoEProblem(NUM_EXPERTS, HIDDEN, INTER, TOP_K, torch.bfloat16, torch.device(DEVICE))
    row["plans"] = {name: {"decode": plan.decode, "gate_up": plan.gate_up.as_list(), "down": plan.down.as_list(),
                           "fused_act": plan.fused_act, "y_fp32": plan.y_fp32}
                    for name, plan in (("fp8_w", fp8_plan(batch, TOP_K, problem, False)),
                                       ("fp8_w8a8", fp8_plan(batch, TOP_K, problem, True)))}
    row["gbps"] = {name: touched_bytes(batch, 1 if name.startswith("fp8") else 2) / us / 1e3
                   for name, us in row["us"].items() if isinstance(us, float)}
    if sweep:  # sorted-path tiles, and GEMV tiles at T <= 8
        row["sweep"] = {}
        for name, act_quant in (("fp8_w", False), ("fp8_w8a8", True)):
            if name not in sweep:
                continue
            sets = {}
            for label, plan in sweep_plans(batch, act_quant).items():
                for weight_scale in ("tile",) if act_quant or plan.decode else ("tile", "product"):
                    sets[label + ("_p" if weight_scale == "product" else "")] = [
                        lambda w=w, i=i, plan=plan, aq=act_quant, ws=weight_scale:
                        fused_moe_fp8(i[0], *w[2:], i[1], i[2], act_quant=aq, plan=plan, pdl=pdl, weight_scale=ws)
                        for w, i in zip(weights, inputs)]
            row["sweep"][name] = time_interleaved(sets, rounds=1)
    return row


def sweep_table(rows: list[dict], device: str) -> list[dict]:
    """Tile-table entries (moe_plan's format) of the sweep's fastest sorted-path tile per T, one entry per
    multiplication; T whose fastest candidate is a GEMV tile or a product-scaled one (no plan field) are left out."""
    entries = []
    for name in ("fp8_w8a8", "fp8_w"):
        tiles = []
        for row in rows:
            times = {k: v for k, v in row.get("sweep", {}).get(name, {}).items() if isinstance(v, float)}
            if not times:
                continue
            best = min(times, key=times.get)
            if best.startswith("gemv_") or best.endswith("_p"):
                continue
            plan = sweep_plans(row["tokens"], name == "fp8_w8a8")[best]
            tiles.append({"max_tokens": row["tokens"], "gate_up": plan.gate_up.as_list(), "down": plan.down.as_list(),
                          "y_fp32": plan.y_fp32, "fused_act": plan.fused_act, "weights_tma": plan.weights_tma,
                          "us": round(times[best], 1)})
        if tiles:
            entries.append({"device": device, "dtype": name, "experts": NUM_EXPERTS, "hidden": HIDDEN,
                            "inter": INTER, "top_k": TOP_K,
                            "tiles": sorted(tiles, key=lambda t: t["max_tokens"])})
    return entries


def print_moe_table(rows: list[dict]) -> None:
    names = ["bf16", "fp8_w", "fp8_w8a8", "fp8_wp", "bf16_sorted", "fp8_w_sorted", "fp8_w8a8_sorted"]
    print(f"\n{'T':>6} " + " ".join(f"{n + ' us':>14}" for n in names)
          + f" {'bf16/w':>7} {'bf16/w8a8':>9} {'err w':>8} {'err w8a8':>8}")
    for row in rows:
        us = row["us"]

        def cell(n):
            v = us.get(n)
            failed = v is not None or isinstance(row["check_rel_err"].get(n), str)
            return f"{v:14.1f}" if isinstance(v, float) else f"{'error' if failed else '-':>14}"

        def ratio(n):
            a, b = us.get("bf16"), us.get(n)
            return a / b if isinstance(a, float) and isinstance(b, float) else float("nan")

        def err(n):
            v = row["check_rel_err"].get(n)
            return f"{v:8.1e}" if isinstance(v, float) else f"{'error':>8}"

        print(f"{row['tokens']:>6} " + " ".join(cell(n) for n in names)
              + f" {ratio('fp8_w'):7.2f} {ratio('fp8_w8a8'):9.2f} {err('fp8_w')} {err('fp8_w8a8')}")
        for name, times in row.get("sweep", {}).items():
            ok = {k: v for k, v in times.items() if isinstance(v, float)}
            if ok:
                best = min(ok, key=ok.get)
                print(f"{'':>6}   sweep {name}: best {best} {ok[best]:.1f} us (default {us.get(name)})")


def bench_dense(tokens: list[int], gen, pdl: bool, sweep: bool = False) -> list[dict]:
    rows = []
    for shape_name, (n, k) in DENSE_SHAPES.items():
        sets = []
        for _ in range(DENSE_SETS):
            q, s = quantize_block_fp8(torch.randn(n, k, generator=gen, device=DEVICE) * k**-0.5)
            sets.append((dequantize_block_fp8(q, s, dtype=torch.bfloat16), q, s))
        counters = torch.zeros(split_counter_slots(n), dtype=torch.int32, device=DEVICE)  # as the engine's module
        for batch in tokens:
            xs = [torch.randn(batch, k, generator=gen, device=DEVICE, dtype=torch.bfloat16) for _ in sets]
            variants = {
                "bf16": lambda x, w: F.linear(x, w[0]),
                "fp8_w": lambda x, w, c=counters: fp8_linear(x, w[1], w[2], act_quant=False, pdl=pdl, counters=c),
                "fp8_wp": lambda x, w, c=counters: fp8_linear(x, w[1], w[2], act_quant=False, weight_scale="product",
                                                             pdl=pdl, counters=c),
                "fp8_w8a8": lambda x, w, c=counters: fp8_linear(x, w[1], w[2], act_quant=True, pdl=pdl, counters=c),
                "fp8_scaled_mm": lambda x, w: fp8_linear(x, w[1], w[2], act_quant=True, backend="scaled_mm"),
            }
            row = {"shape": shape_name, "out": n, "in": k, "tokens": batch, "check_rel_err": {}}
            ref = variants["bf16"](xs[0], sets[0])
            for name, fn in variants.items():
                if name != "bf16":
                    try:
                        row["check_rel_err"][name] = _rel(fn(xs[0], sets[0]), ref)
                    except Exception as exc:
                        row["check_rel_err"][name] = f"{type(exc).__name__}: {exc}"[:300]
            fn_sets = {name: [lambda x=x, w=w, fn=fn: fn(x, w) for x, w in zip(xs, sets)]
                       for name, fn in variants.items() if not isinstance(row["check_rel_err"].get(name), str)}
            row["us"] = time_interleaved(fn_sets)
            if sweep:
                sets_by_tile = {}
                for bm, bn, bk, warps, stages in DENSE_SWEEP_TILES:
                    tile = GemmTile(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
                    for name, act_quant in (("fp8_w", False), ("fp8_w8a8", True)):
                        sets_by_tile[f"{name}_{bm}x{bn}x{bk}w{warps}s{stages}"] = [
                            lambda x=x, w=w, t=tile, aq=act_quant: fp8_linear(x, w[1], w[2], act_quant=aq, tile=t,
                                                                              pdl=pdl)
                            for x, w in zip(xs, sets)]
                for bm, bn, bk, warps, stages, sk in DENSE_SPLIT_TILES:
                    if bm > max(16, batch):  # row tiles past the batch: padding
                        continue
                    tile = GemmTile(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
                    tile_counters = torch.zeros(split_counters(batch, n, tile), dtype=torch.int32, device=DEVICE)
                    for name, act_quant in (("fp8_w", False), ("fp8_w8a8", True)):
                        label = f"{name}_{bm}x{bn}x{bk}w{warps}s{stages}k{sk}"
                        err = _rel(fp8_linear(xs[0], sets[0][1], sets[0][2], act_quant=act_quant, tile=tile,
                                              split_k=sk, counters=tile_counters, pdl=pdl), ref)
                        if err > 0.05 or tile_counters.any():  # a wrong sum or a counter left set: not timed
                            print(f"      split {label}: rel err {err:.2e}, counters {tile_counters.tolist()[:8]}",
                                  flush=True)
                            row.setdefault("split_errors", {})[label] = err
                            tile_counters.zero_()
                            continue
                        sets_by_tile[label] = [
                            lambda x=x, w=w, t=tile, aq=act_quant, sk=sk, c=tile_counters: fp8_linear(
                                x, w[1], w[2], act_quant=aq, tile=t, split_k=sk, counters=c, pdl=pdl)
                            for x, w in zip(xs, sets)]
                if batch <= GEMV_MAX_ROWS:
                    for bn, bk, warps, stages in DENSE_GEMV_SWEEP:
                        g = GemvTile(bn, bk, warps, stages)
                        sets_by_tile[f"fp8_w_gemv_{bn}x{bk}w{warps}s{stages}"] = [
                            lambda x=x, w=w, g=g: fp8_linear(x, w[1], w[2], act_quant=False, gemv_tile=g, pdl=pdl)
                            for x, w in zip(xs, sets)]
                row["sweep"] = time_interleaved(sets_by_tile, rounds=1)
                ok = {k: v for k, v in row["sweep"].items() if "_gemv_" in k and isinstance(v, float)}
                if ok:
                    print("      gemv: " + " ".join(f"{k.removeprefix('fp8_w_gemv_')}={v:.1f}"
                                                    for k, v in sorted(ok.items(), key=lambda kv: kv[1])), flush=True)
                for name in ("fp8_w", "fp8_w8a8"):
                    ok = {k: v for k, v in row["sweep"].items() if k.startswith(name + "_") and isinstance(v, float)}
                    if ok:
                        top = sorted(ok, key=ok.get)[:4]
                        print(f"      sweep {name}: " + "  ".join(f"{k.removeprefix(name + '_')} {ok[k]:.1f}"
                                                                 for k in top) + " us", flush=True)
            rows.append(row)
            print(f"dense {shape_name:>4} T={batch:>5}: " + "  ".join(
                f"{name} {v:.1f} us" if isinstance(v, float) else f"{name} error" for name, v in row["us"].items())
                + "  err " + " ".join(f"{name} {v:.1e}" if isinstance(v, float) else f"{name} {v}"
                                       for name, v in row["check_rel_err"].items()), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels.fp8_moe", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out/")
    ap.add_argument("--tokens", default=TOKENS, help="comma list of token counts T")
    ap.add_argument("--parts", default="moe,dense", help="comma list: moe, dense")
    ap.add_argument("--sweep", action="store_true", help="also time FP8 tile candidates (moe and dense)")
    ap.add_argument("--tune", action="store_true",
                    help="tune the W8A8 sorted path's gate_up and down tiles apart at each T (moe part only); "
                         "writes DIR/moe_tiles_fp8_tuned.json")
    ap.add_argument("--sweep-mult", default="fp8_w8a8,fp8_w",
                    help="comma list of the MoE multiplications --sweep tunes: fp8_w8a8, fp8_w")
    ap.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=None,
                    help="launch with programmatic dependent launch, as the engine does (default: where the GPU "
                         "has it)")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    if not parts <= {"moe", "dense"}:
        ap.error(f"--parts: unknown part(s) {sorted(parts - {'moe', 'dense'})}")
    if not torch.cuda.is_available():
        print("the FP8 kernel benchmark needs a CUDA device")
        return 1
    if torch.cuda.get_device_capability() < (8, 9):
        print(f"FP8 needs compute capability 8.9 or later; this GPU is {torch.cuda.get_device_capability()}")
        return 1
    pdl = pdl_supported(torch.device(DEVICE)) if args.pdl is None else args.pdl
    tokens = [int(t) for t in args.tokens.split(",")]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    copy_bps, read_bps = bandwidths()
    print(f"{device}: copy {copy_bps / 1e9:.0f} GB/s (read+write), read-only sum {read_bps / 1e9:.0f} GB/s, "
          f"pdl {pdl}", flush=True)
    report = {"device": device, "pdl": pdl, "fp8_dtype": str(FP8_DTYPE),
              "shape": dict(experts=NUM_EXPERTS, hidden=HIDDEN, inter=INTER, top_k=TOP_K),
              "bandwidth": {"copy_gbps": copy_bps / 1e9, "read_gbps": read_bps / 1e9}, "moe": [], "dense": []}

    def save():
        (out_dir / "fp8_moe_bench.json").write_text(json.dumps(report, indent=1))

    t0 = time.time()
    gen = torch.Generator(DEVICE).manual_seed(0)
    if args.tune:
        weights = [make_weights(gen) for _ in range(NUM_SETS)]
        report["tune"] = []
        for batch in tokens:
            r = tune_w8a8(batch, gen, weights, pdl)
            report["tune"].append(r)
            save()
            print(f"tune T={batch:5d}: engine {r['engine_gate_up']} / {r['engine_down']} {r['engine_us']:.1f} us -> "
                  f"{r['best']} {r['gate_up']} / {r['down']} tma {r['weights_tma']} {r['us']:.1f} us "
                  f"{r['finalists_us']}  [{time.time() - t0:.0f} s]", flush=True)
        tiles = [{"max_tokens": r["tokens"], "gate_up": r["gate_up"], "down": r["down"], "y_fp32": False,
                  "fused_act": False, "weights_tma": r["weights_tma"], "us": round(r["us"], 1)}
                 for r in report["tune"]]
        (out_dir / "moe_tiles_fp8_tuned.json").write_text(json.dumps({"version": 1, "entries": [
            {"device": device, "dtype": "fp8_w8a8", "experts": NUM_EXPERTS, "hidden": HIDDEN, "inter": INTER,
             "top_k": TOP_K, "tiles": tiles}]}, indent=1))
        del weights
        torch.cuda.empty_cache()
        return 0
    if "moe" in parts:
        weights = [make_weights(gen) for _ in range(NUM_SETS)]
        for batch in tokens:
            try:
                report["moe"].append(bench_moe_batch(batch, gen, weights, pdl,
                                                     tuple(args.sweep_mult.split(",")) if args.sweep else ()))
                print_moe_table(report["moe"][-1:])
            except Exception:
                traceback.print_exc()
            save()
        print_moe_table(report["moe"])
        del weights
        torch.cuda.empty_cache()
    if args.sweep and report["moe"]:
        table = {"version": 1, "entries": sweep_table(report["moe"], device)}
        (out_dir / "moe_tiles_fp8.json").write_text(json.dumps(table, indent=1))
    if "dense" in parts:
        report["dense"] = bench_dense(tokens, gen, pdl, args.sweep)
        save()
    print(f"\nwrote {out_dir / 'fp8_moe_bench.json'} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
