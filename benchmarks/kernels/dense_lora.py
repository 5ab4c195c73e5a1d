"""Dense multi-LoRA (shrink + expand) at Qwen3-30B-A3B shapes, against the base GEMM it rides on.

    python -m benchmarks.kernels.kernels --parts dense_lora [--batches 1,8,64,256,512] [--sweep]

For the fused q|k|v projection (2048 -> 4096+512+512) and o_proj (4096 -> 2048), per T and adapter
case, two CUDA graphs, timed interleaved (A, B, A, B) and reported as medians: the base GEMM alone and
base + LoRA. Each graph rotates through copies of weights,
adapters and inputs that together are far larger than L2, as when 48 layers run between two calls of
one layer. Cases: 1, 4 and 8 rank-16 adapters on every row, 4 on every other row, and one rank-8 adapter,
all in an 8-slot rank-64 pool. The kernel is also checked against the fp32 reference. The rows are grouped by
slot once, outside the timed graphs, as the model does once per forward for all its projections; that launch
alone is reported as `group us`. `--sweep` times tile, split and row-block candidates around the defaults at
decode sizes.
(A one-launch variant, shrink and expand in one program, measured slower at every T on the H200 and was
removed: BENCHMARKS.md, session 4.)
"""
from __future__ import annotations

import math
import statistics
import traceback

import torch

from moeserve.bench.common import graph_time_us
from moeserve.kernels.lora_dense import _dense_lora, dense_lora_ref, group_rows

DEVICE = "cuda"
PROJS = {"qkv": ((4096, 512, 512), 2048), "o": ((2048,), 4096)}  # slice sizes, in features
NUM_SLOTS, MAX_RANK = 8, 64
CASES = {  # name -> (rank of each slot, adapters in use, fraction of rows with an adapter)
    "lora1_r16": ([16] + [0] * 7, 1, 1.0),
    "lora4_r16": ([16] * 4 + [0] * 4, 4, 1.0),
    "lora4_r16_half": ([16] * 4 + [0] * 4, 4, 0.5),
    "lora8_r16": ([16] * 8, 8, 1.0),
    "lora1_r8_of_64": ([8] + [0] * 7, 1, 1.0),
}
L2_FLUSH_BYTES = 256 << 20  # the copies one timed graph cycles through
ROUNDS = 3  # interleaved repeats of (base, base + LoRA)
SWEEP_T = (1, 8, 64, 256, 512, 2048, 8192)
SWEEP = ([dict(block_n=n, num_warps=w) for n in (32, 64, 128, 256) for w in (4, 8)]
         + [dict(block_k=k) for k in (128, 256, 512)] + [dict(k_splits=n) for n in (1, 2, 4, 8)]
         + [dict(block_t=t) for t in (16, 32, 64)] + [dict(block_t=32, block_n=256), dict(block_t=16, k_splits=1)])


def make_sets(T: int, slice_sizes, in_features: int, gen):
    """Copies of (x, W, out, A, B); adapters filled to the pool's max rank (the kernels read to the slot's rank)."""
    n_total = sum(slice_sizes)
    per_copy = 2 * (n_total * in_features + NUM_SLOTS * MAX_RANK * (len(slice_sizes) * in_features + n_total)
                    + T * (in_features + n_total))
    copies = max(2, min(16, math.ceil(L2_FLUSH_BYTES / per_copy)))

    def normal(*shape, std=0.02):
        return torch.randn(*shape, generator=gen, device=DEVICE, dtype=torch.bfloat16) * std

    return [(normal(T, in_features, std=1.0), normal(n_total, in_features),
             torch.zeros(T, n_total, device=DEVICE, dtype=torch.bfloat16),
             normal(NUM_SLOTS, len(slice_sizes), MAX_RANK, in_features), normal(NUM_SLOTS, n_total, MAX_RANK))
            for _ in range(copies)]


def case_slots(T: int, case: str):
    ranks, in_use, frac = CASES[case]
    slots = torch.arange(T, device=DEVICE) % in_use
    if frac < 1.0:
        slots = torch.where(torch.arange(T, device=DEVICE) % 2 == 1, -1, slots)
    return slots.to(torch.int32), torch.tensor(ranks, dtype=torch.int32, device=DEVICE)


def time_modes(sets, slice_sizes, slots, ranks, modes: dict) -> tuple[dict, dict]:
    """Median µs per call of each mode, the modes timed interleaved ROUNDS times; and the modes that failed."""
    def graph_fns(path, cfg):
        cfg = dict(cfg)
        if path is not None:  # grouped once, outside the graph (the model groups once per forward)
            cfg["groups"] = group_rows(slots, NUM_SLOTS, cfg.pop("block_t", None))

        def one(s):
            x, w, out, a, b = s
            torch.mm(x, w.t(), out=out)
            if path is not None:
                path(x, a, b, slots, ranks, slice_sizes, out, **cfg)
        return [lambda s=s: one(s) for s in sets]

    times, failed = {name: [] for name in modes}, {}
    for _ in range(ROUNDS):
        for name, (path, cfg) in modes.items():
            if name in failed:
                continue
            try:
                times[name].append(graph_time_us(graph_fns(path, cfg)))
            except Exception as exc:  # a sweep candidate that does not compile is reported, not fatal
                failed[name] = repr(exc)[:300]
    return {name: statistics.median(t) for name, t in times.items() if t}, failed


def check(sets, slice_sizes, slots, ranks) -> float:
    """Max error of the kernel relative to the fp32 reference's largest delta."""
    x, _, _, a, b = sets[0]
    a, b = a.clone(), b.clone()  # the pool contract: columns past a slot's rank are zero
    for slot, rank in enumerate(ranks.tolist()):
        a[slot, :, rank:] = 0
        b[slot, :, rank:] = 0
    want = torch.zeros(x.shape[0], sum(slice_sizes), device=DEVICE)
    dense_lora_ref(x, a, b, slots, ranks, slice_sizes, want)
    got = torch.zeros(x.shape[0], sum(slice_sizes), device=DEVICE, dtype=torch.bfloat16)
    _dense_lora(x, a, b, slots, ranks, slice_sizes, got)
    return ((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()


def bench_shape(proj: str, T: int, gen, sweep: bool) -> list[dict]:
    slice_sizes, in_features = PROJS[proj]
    sets = make_sets(T, slice_sizes, in_features, gen)
    rows = []
    for case in CASES:
        slots, ranks = case_slots(T, case)
        us, failed = time_modes(sets, slice_sizes, slots, ranks, {"base": (None, {}), "lora": (_dense_lora, {})})
        if failed:
            raise RuntimeError(f"dense lora {proj} T={T} {case}: {failed}")
        group_us = statistics.median(graph_time_us([lambda: group_rows(slots, NUM_SLOTS)]) for _ in range(ROUNDS))
        rows.append(dict(proj=proj, T=T, case=case, base_us=us["base"], lora_us=us["lora"], group_us=group_us,
                         ratio=us["lora"] / us["base"], err=check(sets, slice_sizes, slots, ranks)))
        if sweep and case == "lora4_r16" and T in SWEEP_T:
            variants = {"default": (_dense_lora, {})}
            variants.update({",".join(f"{k}={v}" for k, v in cfg.items()): (_dense_lora, cfg) for cfg in SWEEP})
            rows[-1]["sweep_us"], rows[-1]["sweep_failed"] = time_modes(sets, slice_sizes, slots, ranks, variants)
        print(f"dense lora {proj} T={T} {case}: base {us['base']:.1f} us, +lora {us['lora'] - us['base']:.1f} "
              f"(grouping once a forward {group_us:.1f})", flush=True)
    del sets
    return rows


def run(batches: list[int], sweep: bool, gen, rows: list[dict], save) -> None:
    """Appends to `rows` and calls save() after every shape, so a run cut short keeps its numbers."""
    for proj in PROJS:
        for T in batches:
            try:
                rows += bench_shape(proj, T, gen, sweep)
            except Exception:
                traceback.print_exc()
            save()


def print_table(rows: list[dict]) -> None:
    print(f"\ndense LoRA (bf16, {NUM_SLOTS}-slot rank-{MAX_RANK} pool): graph replays, medians of {ROUNDS} "
          f"interleaved rounds; ratio = (base GEMM + LoRA) / base GEMM")
    print(f"{'proj':>4} {'T':>4} {'case':>15} {'base us':>8} {'+lora us':>8} {'ratio':>6} {'group us':>8} {'err':>8}")
    for r in rows:
        print(f"{r['proj']:>4} {r['T']:>4} {r['case']:>15} {r['base_us']:>8.1f} {r['lora_us'] - r['base_us']:>8.1f} "
              f"{r['ratio']:>6.3f} {r['group_us']:>8.1f} {r['err']:>8.1e}")
    for r in rows:
        sw = r.get("sweep_us")
        if sw and "default" in sw:
            best = min(sw, key=sw.get)
            print(f"  sweep {r['proj']} T={r['T']} lora4 (base+lora us): default {sw['default']:.1f}, "
                  f"best {best} {sw[best]:.1f} | " + " ".join(f"{k}:{v:.1f}" for k, v in sw.items()
                                                              if k != "default"))
        for name, err in r.get("sweep_failed", {}).items():
            print(f"  sweep {r['proj']} T={r['T']} {name} failed: {err}")
