"""The Triton GEMV (kernels/gemv.py) against cuBLAS for the dense projections at decode sizes.

    python -m benchmarks.kernels.kernels --parts gemv [--sweep]

Per shape (q|k|v and o_proj of the Qwen3-30B-A3B, OLMoE-1B-7B and Qwen1.5-MoE-A2.7B presets, Qwen1.5's shared
expert, the 151936-row lm_head) and T in 1, 2 (the rows it serves): µs per call of cuBLAS (torch.mm / addmm into a
preallocated output) and of gemv at its default config, as CUDA-graph replays that rotate through copies of
weights and inputs far larger than L2 (as when 48 layers run between two calls of one layer), timed
interleaved (A, B, A, B) and reported as medians; GB/s of the weight + activation bytes and their share of
the read bandwidth measured in the same run. With 1, 4 and 8 rank-16 adapters on every row (8-slot rank-64
pool) for the LoRA-carrying projections: cuBLAS + shrink + expand (today's two LoRA launches) against
shrink + gemv with the expand in its epilogue. Each path is checked against fp32 torch first.
`--sweep`: per shape and T, block_n x block_k at 4 warps, then the best of those over warps; prints the best
config per (shape, T) next to the default. (At T = 4 and 8 cuBLAS won at every shape, also against a
tensor-core variant and K splits of this kernel: BENCHMARKS.md, session 5.)
"""
from __future__ import annotations

import math
import statistics
import traceback

import torch
import triton

from moeserve.bench.common import graph_time_us
from moeserve.kernels.gemv import GemvConfig, GemvLoRA, default_config, gemv
from moeserve.kernels.lora_dense import _dense_lora, dense_lora_ref, dense_lora_shrink

DEVICE = "cuda"
TOKENS = (1, 2)
SHAPES = {  # name -> (slice sizes, in features, bias, carries LoRA)
    "qwen3 qkv": ((4096, 512, 512), 2048, False, True),
    "qwen3 o": ((2048,), 4096, False, True),
    "qwen3 lm_head": ((151936,), 2048, False, False),
    "olmoe qkv": ((2048, 2048, 2048), 2048, False, True),
    "olmoe/qwen1.5 o": ((2048,), 2048, False, True),
    "qwen1.5 qkv": ((2048, 2048, 2048), 2048, True, True),
    "qwen1.5 shared gate_up": ((5632, 5632), 2048, False, True),
    "qwen1.5 shared down": ((2048,), 5632, False, True),
}
NUM_SLOTS, MAX_RANK = 8, 64
LORA_CASES = {"lora1_r16": 1, "lora4_r16": 4, "lora8_r16": 8}  # adapters in use, every row has one
L2_FLUSH_BYTES = 256 << 20
ROUNDS = 3
SWEEP_N, SWEEP_K, SWEEP_WARPS = (4, 8, 16, 32), (256, 512, 1024), (2, 8)


def make_sets(T: int, slice_sizes, K: int, bias: bool, gen, lora: bool):
    """Copies of (x, W, bias, out, A, B): together >= L2_FLUSH_BYTES, at least 2."""
    N = sum(slice_sizes)
    lora_bytes = NUM_SLOTS * MAX_RANK * (len(slice_sizes) * K + N) if lora else 0
    per_copy = 2 * (N * K + T * (K + N) + lora_bytes)
    copies = max(2, min(16, math.ceil(L2_FLUSH_BYTES / per_copy)))

    def normal(*shape, std=0.02):
        return torch.randn(*shape, generator=gen, device=DEVICE, dtype=torch.bfloat16) * std

    sets = []
    for _ in range(copies):
        s = dict(x=normal(T, K, std=1.0), w=normal(N, K), b=normal(N) if bias else None,
                 out=torch.empty(T, N, device=DEVICE, dtype=torch.bfloat16))
        if lora:
            s["a"], s["lb"] = normal(NUM_SLOTS, len(slice_sizes), MAX_RANK, K), normal(NUM_SLOTS, N, MAX_RANK)
        sets.append(s)
    return sets


def cublas(s) -> None:
    if s["b"] is None:
        torch.mm(s["x"], s["w"].t(), out=s["out"])
    else:
        torch.addmm(s["b"], s["x"], s["w"].t(), out=s["out"])


def paths(slice_sizes, slots=None, ranks=None) -> dict:
    """name -> fn(set): the base paths, or with `slots` the two LoRA paths."""
    if slots is None:
        return {"cublas": cublas, "gemv": lambda s: gemv(s["x"], s["w"], s["b"], out=s["out"])}

    def two_launch(s):
        cublas(s)
        _dense_lora(s["x"], s["a"], s["lb"], slots, ranks, slice_sizes, s["out"])

    def fused(s):
        scratch = dense_lora_shrink(s["x"], s["a"], slots, ranks)
        gemv(s["x"], s["w"], s["b"], out=s["out"], lora=GemvLoRA(scratch, s["lb"], slots, ranks, slice_sizes))

    return {"cublas+shrink+expand": two_launch, "shrink+gemv_expand": fused}


def time_modes(sets, modes: dict) -> tuple[dict, dict]:
    """Median µs per call of each mode over ROUNDS interleaved rounds; and the modes that failed."""
    times, failed = {name: [] for name in modes}, {}
    for _ in range(ROUNDS):
        for name, fn in modes.items():
            if name in failed:
                continue
            try:
                times[name].append(graph_time_us([lambda s=s, fn=fn: fn(s) for s in sets]))
            except Exception as exc:  # a candidate that does not compile is reported, not fatal
                failed[name] = repr(exc)[:300]
    return {name: statistics.median(t) for name, t in times.items() if t}, failed


def max_rel_err(s, fn, slice_sizes, slots=None, ranks=None) -> float:
    """fn's output on set s against fp32 torch (with the LoRA reference when slots are given)."""
    want = torch.nn.functional.linear(s["x"].float(), s["w"].float(), None if s["b"] is None else s["b"].float())
    if slots is not None:
        dense_lora_ref(s["x"].float(), s["a"].float(), s["lb"].float(), slots, ranks, slice_sizes, want)
    fn(s)
    return ((s["out"].float() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()


def lora_pool_case(sets, in_use: int):
    """Ranks 16 in the first `in_use` slots, 0 after; A/B zeroed past each slot's rank (the pool contract)."""
    ranks = [16] * in_use + [0] * (NUM_SLOTS - in_use)
    for s in sets:
        for slot, r in enumerate(ranks):
            s["a"][slot, :, r:] = 0
            s["lb"][slot, :, r:] = 0
    return torch.tensor(ranks, dtype=torch.int32, device=DEVICE)


def sweep(sets, T: int, N: int, K: int) -> tuple[dict, dict]:
    """µs of candidate configs: block_n x block_k at 4 warps, then the best of those at other warp counts."""
    def run(cfgs):
        modes = {_name(c): (lambda s, c=c: gemv(s["x"], s["w"], s["b"], out=s["out"], config=c)) for c in cfgs}
        return time_modes(sets, modes)

    rows = triton.next_power_of_2(T)
    # tiles whose [T, block_n, block_k] fp32 running sums would need > 128 registers a thread only spill
    stage1 = [GemvConfig(bn, bk, 4) for bn in SWEEP_N for bk in SWEEP_K
              if bk <= max(K, 64) and rows * bn * bk <= 128 * 128]
    us, failed = run(stage1)
    if not us:
        return us, failed
    best = min(stage1, key=lambda c: us.get(_name(c), math.inf))
    stage2 = [best._replace(num_warps=w) for w in SWEEP_WARPS]
    us2, failed2 = run(stage2)
    return {**us, **us2}, {**failed, **failed2}


def _name(c: GemvConfig) -> str:
    return f"n{c.block_n} k{c.block_k} w{c.num_warps}"


def bench_shape(name: str, T: int, gen, do_sweep: bool, read_gbps: float) -> list[dict]:
    slice_sizes, K, bias, has_lora = SHAPES[name]
    N = sum(slice_sizes)
    sets = make_sets(T, slice_sizes, K, bias, gen, has_lora)
    nbytes = 2 * (N * K + T * (K + N))
    base = paths(slice_sizes)
    errs = {p: max_rel_err(sets[0], fn, slice_sizes) for p, fn in base.items()}
    us, failed = time_modes(sets, base)
    if failed:
        raise RuntimeError(f"gemv bench {name} T={T}: {failed}")
    row = dict(shape=name, T=T, N=N, K=K, bytes=nbytes, default=_name(default_config(N, K)),
               us=us, err=errs, gbps={p: nbytes / (t * 1e3) for p, t in us.items()},
               frac_read_bw={p: nbytes / (t * 1e3) / read_gbps for p, t in us.items()}, lora={})
    print(f"gemv {name} T={T}: cublas {us['cublas']:.1f} us, gemv {us['gemv']:.1f} us "
          f"({100 * row['frac_read_bw']['gemv']:.0f} % of read bw)", flush=True)
    if has_lora:
        slots_all = torch.arange(T, device=DEVICE, dtype=torch.int32)
        for case, in_use in LORA_CASES.items():
            ranks = lora_pool_case(sets, in_use)
            slots = slots_all % in_use
            modes = paths(slice_sizes, slots, ranks)
            lerr = {p: max_rel_err(sets[0], fn, slice_sizes, slots, ranks) for p, fn in modes.items()}
            lus, lfailed = time_modes(sets, modes)
            if lfailed:
                raise RuntimeError(f"gemv bench {name} T={T} {case}: {lfailed}")
            row["lora"][case] = dict(us=lus, err=lerr)
    if do_sweep:
        row["sweep_us"], row["sweep_failed"] = sweep(sets, T, N, K)
    del sets
    return [row]


def run(do_sweep: bool, gen, rows: list[dict], save, read_gbps: float) -> None:
    """Appends to `rows` and calls save() after every shape, so a run cut short keeps its numbers."""
    for name in SHAPES:
        for T in TOKENS:
            try:
                rows += bench_shape(name, T, gen, do_sweep, read_gbps)
            except Exception:
                traceback.print_exc()
            save()


def print_table(rows: list[dict], read_gbps: float) -> None:
    print(f"\ngemv vs cuBLAS (bf16, graph replays over copies >> L2, medians of {ROUNDS} interleaved rounds); "
          f"%bw = share of the {read_gbps:.0f} GB/s read bandwidth; LoRA: {NUM_SLOTS}-slot rank-{MAX_RANK} pool, "
          "rank-16 adapters on every row, us of (cuBLAS + shrink + expand) -> (shrink + gemv with expand)")
    head = (f"{'shape':>22} {'T':>2} {'cublas':>7} {'gemv':>7} {'%bw cb':>6} {'%bw gv':>6} {'err':>7} "
            + " ".join(f"{c:>14}" for c in LORA_CASES))
    print(head)
    for r in rows:
        cells = []
        for c in LORA_CASES:
            u = r["lora"].get(c, {}).get("us")
            cells.append(f"{u['cublas+shrink+expand']:>6.1f}->{u['shrink+gemv_expand']:<6.1f}" if u else f"{'-':>14}")
        lora = " ".join(cells)
        print(f"{r['shape']:>22} {r['T']:>2} {r['us']['cublas']:>7.1f} {r['us']['gemv']:>7.1f} "
              f"{100 * r['frac_read_bw']['cublas']:>6.0f} {100 * r['frac_read_bw']['gemv']:>6.0f} "
              f"{r['err']['gemv']:>7.1e} {lora}")
    swept = [r for r in rows if r.get("sweep_us")]
    if swept:
        print("\ngemv config sweep: best per (shape, T) against the default (us)")
        for r in swept:
            sw = r["sweep_us"]
            best = min(sw, key=sw.get)
            default_us = sw.get(r["default"], r["us"]["gemv"])
            top = sorted(sw, key=sw.get)[:3]
            print(f"{r['shape']:>22} T={r['T']}: default [{r['default']}] {default_us:.1f}, best [{best}] "
                  f"{sw[best]:.1f} ({100 * r['bytes'] / (sw[best] * 1e3) / read_gbps:.0f} % bw); next: "
                  + ", ".join(f"[{k}] {sw[k]:.1f}" for k in top[1:]))
            for name, err in r.get("sweep_failed", {}).items():
                print(f"  {name} failed: {err}")
