"""Tune the fused MoE's sorted-path tiles for this GPU and one problem shape, and write the tile table.

    python -m benchmarks.kernels.kernels --tune [--shape E,H,I,K] [--dtype bfloat16]
                                            [--batches 16,32,...,8192] [--out bench_out/]

For each token count T and each candidate block_m: coordinate descent over the gate_up tiles (with a fixed down
tile), then over the down tiles (with the best gate_up one); then the best plan of each block_m and the heuristic's
plan timed again, interleaved, and the fastest kept. Every time is a CUDA-graph replay of the whole fused_moe
(alignment and top-k sum included) rotating through weight sets larger than the L2 (cold cache, as between layers).
Also timed per T, for reference: the alignment alone, and the two grouped GEMMs alone through torch's grouped GEMM
(`torch._grouped_mm`, CUTLASS), on the rows already sorted by expert (no gather, no activation, no top-k sum).

Writes `moe_tiles_<gpu>.json` (the format of moeserve/kernels/moe_tiles.json: merge its entry there, or point
MOESERVE_MOE_TILES at the file) and `moe_tune_report.json` with every time. Calls without LoRA use the table.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from moeserve.bench.common import graph_time_us
from moeserve.kernels.fused_moe import fused_moe
from moeserve.kernels.moe_align import moe_align
from moeserve.kernels.moe_plan import GemmTile, MoEPlan, MoEProblem, fit_plan, heuristic_plan

DEVICE = "cuda"
BATCHES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# (block_n, block_k, num_warps, num_stages, group_m) per block_m; the same list serves gate_up and down
CANDIDATES = {
    16: [(128, 128, 4, 3, 1), (128, 64, 4, 4, 1), (64, 128, 4, 3, 1), (256, 64, 4, 3, 1), (128, 128, 4, 4, 1),
         (256, 64, 8, 3, 1), (128, 128, 4, 3, 4), (256, 64, 4, 3, 4), (64, 128, 4, 3, 8), (256, 128, 4, 3, 4),
         (128, 128, 4, 4, 4)],
    32: [(128, 128, 4, 3, 1), (128, 64, 4, 4, 1), (256, 128, 4, 2, 1), (256, 64, 8, 3, 1), (128, 64, 4, 3, 1),
         (64, 128, 4, 3, 1), (256, 128, 4, 2, 16), (128, 128, 4, 3, 4)],
    64: [(128, 64, 4, 3, 1), (128, 64, 8, 3, 1), (256, 64, 8, 3, 1), (256, 64, 8, 4, 1), (128, 128, 8, 3, 1),
         (256, 64, 8, 4, 8), (128, 64, 4, 4, 8)],
    128: [(256, 64, 8, 4, 1), (256, 64, 8, 4, 16), (128, 64, 8, 4, 1), (128, 64, 4, 4, 1), (256, 64, 8, 3, 1),
          (128, 128, 8, 3, 16), (256, 32, 8, 5, 16)],
}


def block_ms_for(num_tokens: int, top_k: int) -> list[int]:
    pairs = num_tokens * top_k
    if pairs <= 512:
        return [16, 32]
    if pairs <= 4096:
        return [16, 32, 64]
    return [64, 128]


def _tile(block_m: int, c: tuple) -> GemmTile:
    bn, bk, warps, stages, group = c
    return GemmTile(block_m, bn, bk, warps, stages, group)


class Problem:
    """Weight and input sets for one shape; each weight set exceeds the L2."""

    def __init__(self, experts, hidden, inter, top_k, dtype, num_sets=4, seed=0):
        self.shape = (experts, hidden, inter, top_k)
        self.dtype = dtype
        gen = torch.Generator(DEVICE).manual_seed(seed)
        self.weights = [((torch.randn(experts, 2 * inter, hidden, generator=gen, device=DEVICE) * 0.02).to(dtype),
                         (torch.randn(experts, hidden, inter, generator=gen, device=DEVICE) * 0.02).to(dtype))
                        for _ in range(num_sets)]
        self.gen = gen

    def inputs(self, num_tokens):
        experts, hidden, _, top_k = self.shape
        out = []
        for _ in self.weights:
            x = torch.randn(num_tokens, hidden, generator=self.gen, device=DEVICE).to(self.dtype)
            logits = torch.randn(num_tokens, experts, generator=self.gen, device=DEVICE)
            w, ids = torch.softmax(logits, -1).topk(top_k, -1)
            out.append((x, w, ids.to(torch.int32)))
        return out

    def time_plan(self, inputs, plan: MoEPlan, pdl: bool) -> float | None:
        fns = [lambda w=w, inp=inp: fused_moe(inp[0], w[0], w[1], inp[1], inp[2], plan=plan, pdl=pdl)
               for w, inp in zip(self.weights, inputs)]
        try:
            return graph_time_us(fns)
        except Exception as exc:  # a candidate that does not compile or fit is skipped
            print(f"    skipped {plan.gate_up.as_list()} / {plan.down.as_list()}: {exc!r}"[:240], flush=True)
            return None

    def time_align(self, inputs, block_m: int, pdl: bool) -> float:
        experts = self.shape[0]
        return graph_time_us([lambda ids=inp[2]: moe_align(ids, experts, block_m, pdl=pdl) for inp in inputs])

    def time_grouped_mm(self, inputs) -> float | None:
        """torch._grouped_mm of gate_up and down over pairs pre-sorted by expert: the GEMMs alone."""
        if not hasattr(torch, "_grouped_mm"):
            return None
        experts, hidden, inter, top_k = self.shape
        fns = []
        for (w13, w2), (x, _, ids) in zip(self.weights, inputs):
            counts = torch.bincount(ids.flatten().long(), minlength=experts)
            offs = counts.cumsum(0).to(torch.int32)
            rows = x[ids.flatten().long().argsort() // top_k]  # each pair's token row, sorted by expert
            b13, b2 = w13.transpose(1, 2), w2.transpose(1, 2)  # [E, K, N] views
            h = torch.empty(rows.shape[0], inter, dtype=self.dtype, device=DEVICE)

            def fn(rows=rows, b13=b13, b2=b2, offs=offs, h=h):
                torch._grouped_mm(rows, b13, offs=offs)
                return torch._grouped_mm(h, b2, offs=offs)
            fns.append(fn)
        try:
            return graph_time_us(fns)
        except Exception as exc:
            print(f"    torch._grouped_mm unavailable: {exc!r}"[:200], flush=True)
            return None


def tune_batch(problem: Problem, num_tokens: int, pdl: bool) -> dict:
    top_k = problem.shape[3]
    inputs = problem.inputs(num_tokens)
    heuristic = fit_plan(heuristic_plan(num_tokens, top_k, decode=False), problem.dtype, torch.device(DEVICE))
    # Hopper and later: the search reads weight tiles through TMA descriptors (H200: 0.91-1.0 of pointer loads at
    # every T, bitwise the same), and pointer loads are a finalist
    tma = torch.cuda.get_device_capability()[0] >= 9
    rows, best_by_m = [], {}
    for block_m in block_ms_for(num_tokens, top_k):
        cands = [_tile(block_m, c) for c in CANDIDATES[block_m]]
        down = cands[0]
        best_gu, best_t = None, None
        for gu in cands:
            t = problem.time_plan(inputs, MoEPlan(False, gu, down, weights_tma=tma), pdl)
            rows.append({"gate_up": gu.as_list(), "down": down.as_list(), "us": t})
            if t is not None and (best_t is None or t < best_t):
                best_gu, best_t = gu, t
        if best_gu is None:
            continue
        best_down = down
        for d in cands[1:]:
            t = problem.time_plan(inputs, MoEPlan(False, best_gu, d, weights_tma=tma), pdl)
            rows.append({"gate_up": best_gu.as_list(), "down": d.as_list(), "us": t})
            if t is not None and t < best_t:
                best_down, best_t = d, t
        best_by_m[block_m] = MoEPlan(False, best_gu, best_down, weights_tma=tma)
    # the finalists (each block_m's best tiles, the overall best with each plan option) and the heuristic,
    # interleaved three times: medians
    finalists = {"heuristic": heuristic, **{f"m{m}": p for m, p in best_by_m.items()}}
    if best_by_m:
        top = min(best_by_m.values(), key=lambda p: problem.time_plan(inputs, p, pdl) or float("inf"))
        finalists.update({"y16": replace(top, y_fp32=False), "act": replace(top, fused_act=False),
                          "y16+act": replace(top, y_fp32=False, fused_act=False)})
        if tma:
            finalists["pointers"] = replace(top, weights_tma=False)
    times = {name: [] for name in finalists}
    for _ in range(3):
        for name, plan in finalists.items():
            t = problem.time_plan(inputs, plan, pdl)
            if t is not None:
                times[name].append(t)
    medians = {name: statistics.median(ts) for name, ts in times.items() if ts}
    best = min((n for n in medians if n != "heuristic"), key=medians.get, default="heuristic")
    plan = finalists[best]
    return {"tokens": num_tokens, "best": best, "gate_up": plan.gate_up.as_list(), "down": plan.down.as_list(),
            "y_fp32": plan.y_fp32, "fused_act": plan.fused_act, "weights_tma": plan.weights_tma,
            "us": medians.get(best), "heuristic_us": medians.get("heuristic"), "finalists_us": medians,
            "align_us": problem.time_align(inputs, plan.gate_up.block_m, pdl),
            "grouped_mm_us": problem.time_grouped_mm(inputs), "candidates": rows}


def run(shape=(128, 2048, 768, 8), dtype="bfloat16", batches=BATCHES, out_dir="bench_out", pdl=True) -> dict:
    experts, hidden, inter, top_k = shape
    torch_dtype = getattr(torch, dtype)
    problem = Problem(experts, hidden, inter, top_k, torch_dtype)
    device = torch.cuda.get_device_name()
    t0 = time.time()
    results = []
    for t in batches:
        r = tune_batch(problem, t, pdl)
        results.append(r)
        print(f"T={t:5d}: best {r['best']:9s} gu {r['gate_up']} down {r['down']} {r['us']:8.1f} us {r['finalists_us']} "
              f"(heuristic {r['heuristic_us']:8.1f}), align {r['align_us']:.1f} us, grouped_mm "
              f"{r['grouped_mm_us'] or float('nan'):.1f} us  [{time.time() - t0:.0f} s]", flush=True)
    entry = {"device": device, "dtype": dtype, "experts": experts, "hidden": hidden, "inter": inter, "top_k": top_k,
             "tiles": [{"max_tokens": r["tokens"], "gate_up": r["gate_up"], "down": r["down"],
                        "y_fp32": r["y_fp32"], "fused_act": r["fused_act"], "weights_tma": r["weights_tma"]}
                       for r in results]}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = "moe_tiles_" + "".join(c if c.isalnum() else "_" for c in device) + ".json"
    (out / name).write_text(json.dumps({"version": 1, "entries": [entry]}, indent=1))
    (out / "moe_tune_report.json").write_text(json.dumps({"device": device, "shape": shape, "dtype": dtype,
                                                          "pdl": pdl, "results": results}, indent=1))
    print(f"\n{device}, E={experts} H={hidden} I={inter} top-{top_k} {dtype}: fused MoE (align + GEMMs + top-k sum), "
          "us per call, CUDA graph, cold L2")
    print(f"{'T':>6} | {'heuristic':>9} | {'tuned':>9} | {'tuned/heur':>10} | {'align':>6} | {'grouped_mm GEMMs':>16} | "
          "tiles gate_up / down (m, n, k, warps, stages, group)")
    for r in results:
        gm = r["grouped_mm_us"]
        print(f"{r['tokens']:>6} | {r['heuristic_us']:>9.1f} | {r['us']:>9.1f} | {r['us'] / r['heuristic_us']:>10.3f} | "
              f"{r['align_us']:>6.1f} | {gm if gm else float('nan'):>16.1f} | {r['gate_up']} / {r['down']}")
    print(f"wrote {out / name}")
    return entry
