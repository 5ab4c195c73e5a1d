"""Decode attention and dense multi-LoRA kernels at Qwen3-30B-A3B shapes.

    python -m moeserve.bench.attention --out DIR [--quick]

Every timing is a CUDA-graph replay of many calls (launch overhead as in graph decode), each
call on a different copy of the data, with the copies together far larger than L2, as when
48 layers run between two calls of one layer. Prints tables; writes DIR/attention_bench.json.
Bandwidth efficiency is against the copy bandwidth (read + write) measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from moeserve.bench.common import bandwidths, graph_time_us
from moeserve.kernels.lora_dense import SINGLE_LAUNCH_MAX_TOKENS, _dense_lora_one_launch, _dense_lora_two_launch
from moeserve.kernels.paged_attention import (
    DECODE_BLOCK_N,
    _launch_decode,
    default_num_splits,
    paged_decode_attention,
)

N_HEADS, N_KV, HEAD_DIM, HIDDEN = 32, 4, 128, 2048
BLOCK_SIZE, MAX_MODEL_LEN = 16, 4096
QKV_SIZES = (N_HEADS * HEAD_DIM, N_KV * HEAD_DIM, N_KV * HEAD_DIM)
L2_FLUSH_BYTES = 256 << 20  # the copies one timed graph cycles through


def copies_for(bytes_per_copy: int, cap: int = 16) -> int:
    return max(2, min(cap, math.ceil(L2_FLUSH_BYTES / max(1, bytes_per_copy))))


# ----------------------------------------------------------------------------- decode attention


def decode_setup(batch: int, ctx: int, copies: int, gen):
    """`copies` independent caches (think: layers) with shuffled block tables."""
    max_blocks = MAX_MODEL_LEN // BLOCK_SIZE
    used = batch * math.ceil(ctx / BLOCK_SIZE)
    num_blocks = 1 + used
    sets = []
    for _ in range(copies):
        k = torch.randn(num_blocks, BLOCK_SIZE, N_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn_like(k)
        tables = torch.zeros(batch, max_blocks, dtype=torch.int32, device="cuda")
        perm = (torch.randperm(num_blocks - 1, device="cuda", generator=gen) + 1).int()
        tables[:, : used // batch] = perm.view(batch, -1)
        q = torch.randn(batch, N_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        sets.append((q, k, v, tables))
    ctx_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return sets, ctx_lens


def bench_decode(batch: int, ctx: int, gen, variants: list[dict]):
    kv_bytes = batch * ctx * N_KV * HEAD_DIM * 2 * 2
    copies = copies_for(kv_bytes)
    sets, ctx_lens = decode_setup(batch, ctx, copies, gen)
    scale = HEAD_DIM**-0.5
    outs = [torch.empty_like(s[0]) for s in sets]
    default_splits = default_num_splits(batch, N_KV, sets[0][3].shape[1], BLOCK_SIZE, torch.device("cuda"))
    rows = []
    for var in variants:
        splits = var.get("num_splits") or default_splits
        cfg = dict(block_n=var.get("block_n", DECODE_BLOCK_N), num_warps=var.get("num_warps", 4),
                   num_stages=var.get("num_stages", 2))
        if var.get("default"):
            fns = [lambda s=s, o=o: paged_decode_attention(*s[:4], ctx_lens, scale, out=o) for s, o in zip(sets, outs)]
        else:
            fns = [lambda s=s, o=o: _launch_decode(*s[:4], ctx_lens, scale, splits, o, **cfg)
                   for s, o in zip(sets, outs)]
        us = graph_time_us(fns)
        rows.append(dict(kernel="decode_attention", batch=batch, ctx=ctx, variant=var.get("name", "default"),
                         num_splits=splits, **cfg, us=us, kv_bytes=kv_bytes, gbps=kv_bytes / us / 1e3))
    # baseline: torch SDPA on contiguous (unpaged) caches of the same size
    try:
        dense = []
        for _ in range(copies):
            kc = torch.randn(batch, N_KV, ctx, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
            qc = torch.randn(batch, N_HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
            dense.append((qc, kc, torch.randn_like(kc)))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        us = graph_time_us([lambda d=d: sdpa(*d, enable_gqa=True) for d in dense])
        rows.append(dict(kernel="sdpa_contiguous_gqa", batch=batch, ctx=ctx, variant="torch", us=us,
                         kv_bytes=kv_bytes, gbps=kv_bytes / us / 1e3))
        del dense
    except Exception as exc:  # the baseline is informative only
        rows.append(dict(kernel="sdpa_contiguous_gqa", batch=batch, ctx=ctx, error=repr(exc)[:200]))
    del sets
    return rows


# ----------------------------------------------------------------------------- dense LoRA


def lora_setup(T: int, slice_sizes, in_features: int, num_slots: int, max_rank: int, rank: int,
               pattern: str, copies: int, gen):
    sets = []
    n_total = sum(slice_sizes)
    for _ in range(copies):
        a = torch.zeros(num_slots, len(slice_sizes), max_rank, in_features, device="cuda", dtype=torch.bfloat16)
        b = torch.zeros(num_slots, n_total, max_rank, device="cuda", dtype=torch.bfloat16)
        a[:, :, :rank].normal_(0, 0.02, generator=gen)
        b[:, :, :rank].normal_(0, 0.02, generator=gen)
        x = torch.randn(T, in_features, device="cuda", dtype=torch.bfloat16, generator=gen)
        out = torch.zeros(T, n_total, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n_total, in_features, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        sets.append((x, a, b, out, w))
    ranks = torch.full((num_slots,), rank, dtype=torch.int32, device="cuda")
    if pattern == "uniform":
        slots = torch.zeros(T, dtype=torch.int32, device="cuda")
    elif pattern == "mixed4":
        slots = torch.randint(0, 4, (T,), device="cuda", generator=gen).int()
    elif pattern == "half_none":
        slots = torch.randint(-4, 4, (T,), device="cuda", generator=gen).clamp_min(-1).int()
    else:
        raise ValueError(pattern)
    return sets, ranks, slots


def bench_lora(T: int, proj: str, pattern: str, gen, variants: list[dict], num_slots=8, max_rank=64, rank=16):
    slice_sizes, in_features = {"qkv": (QKV_SIZES, HIDDEN), "o": ((HIDDEN,), N_HEADS * HEAD_DIM)}[proj]
    n_total = sum(slice_sizes)
    weight_bytes = n_total * in_features * 2
    copies = copies_for(weight_bytes + T * (in_features + n_total) * 2)
    sets, ranks, slots = lora_setup(T, slice_sizes, in_features, num_slots, max_rank, rank, pattern, copies, gen)
    # the base projection this delta rides on: y = x @ W.T
    base_us = graph_time_us([lambda s=s: torch.mm(s[0], s[4].t(), out=s[3]) for s in sets])
    adapters = 1 if pattern == "uniform" else 4
    lora_bytes = adapters * rank * (len(slice_sizes) * in_features + n_total) * 2 + T * (in_features + 2 * n_total) * 2
    rows = []
    for var in variants:
        cfg = {k: var[k] for k in ("block_t", "block_k", "block_n", "k_splits", "lanes", "num_warps") if k in var}
        # the path dense_lora takes at this T
        path = _dense_lora_one_launch if T <= SINGLE_LAUNCH_MAX_TOKENS else _dense_lora_two_launch
        fns = [lambda s=s: path(s[0], s[1], s[2], slots, ranks, slice_sizes, s[3], **cfg) for s in sets]
        us = graph_time_us(fns)
        rows.append(dict(kernel="dense_lora", proj=proj, T=T, pattern=pattern, rank=rank, max_rank=max_rank,
                         variant=var.get("name", "default"), **cfg, us=us, base_gemm_us=base_us,
                         ratio_to_base=us / base_us, bytes=lora_bytes, gbps=lora_bytes / us / 1e3))
    del sets
    return rows


# Tile configs were swept once (block_n 32/64/128 x warps 4/8 x stages 2/3; LoRA block_k
# 128/256/512 x block_n 64/128 x k_splits 1/4): the defaults were best or within 3 %.
# What stays swept: the split count around its default, and LoRA slot lanes.
DECODE_SWEEP = [dict(name="splits_x0.5", num_splits=-1), dict(name="splits_x2", num_splits=-2)]
LORA_SWEEP = [dict(name=f"lanes{n}", lanes=n) for n in (1, 2, 4, 8)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".")
    parser.add_argument("--quick", action="store_true", help="default configs only, no sweeps")
    args = parser.parse_args()
    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    t0 = time.time()
    copy_bw, read_bw = bandwidths(1 << 30)
    rows = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save():  # after every shape, so a run cut short still leaves its numbers
        result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                      triton=__import__("triton").__version__, copy_bw_gbps=copy_bw / 1e9, read_bw_gbps=read_bw / 1e9,
                      seconds=time.time() - t0, rows=rows)
        (out / "attention_bench.json").write_text(json.dumps(result, indent=1))
        return result

    for batch in (1, 8, 32, 64, 128, 256):
        for ctx in (512, 2048):
            variants = [dict(default=True)]
            if not args.quick and batch <= 64:
                variants += [dict(v) for v in DECODE_SWEEP]
            for var in variants:  # split multiples are resolved against the default
                if var.get("num_splits", 0) < 0:
                    d = default_num_splits(batch, N_KV, MAX_MODEL_LEN // BLOCK_SIZE, BLOCK_SIZE, torch.device("cuda"))
                    var["num_splits"] = max(1, d // 2) if var["num_splits"] == -1 else d * 2
            rows += bench_decode(batch, ctx, gen, variants)
            save()
            print(f"decode B={batch} ctx={ctx} done {time.time() - t0:.0f} s", flush=True)
    for proj in ("qkv", "o"):
        for T in (1, 8, 32, 64, 128, 256, 512, 4096):
            for pattern in ("uniform", "mixed4", "half_none"):
                if proj == "o" and pattern != "mixed4":
                    continue
                variants = [dict()]
                if not args.quick and proj == "qkv" and pattern != "half_none" and T in (8, 64, 256):
                    variants += LORA_SWEEP
                rows += bench_lora(T, proj, pattern, gen, variants)
                save()
        print(f"lora {proj} done {time.time() - t0:.0f} s", flush=True)

    result = save()

    print(f"{result['device']}  torch {result['torch']}  triton {result['triton']}  "
          f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (read+write), read bandwidth {read_bw / 1e9:.0f} GB/s")
    print("\ndecode attention (bf16, 32 q / 4 kv heads x 128, block 16): default config vs SDPA on a contiguous cache")
    print(f"{'B':>4} {'ctx':>5} {'splits':>6} {'us':>8} {'GB/s':>7} {'eff':>5} {'sdpa us':>8}")
    for r in rows:
        if r["kernel"] == "decode_attention" and r["variant"] == "default":
            sd = next((x for x in rows if x["kernel"] == "sdpa_contiguous_gqa" and x["batch"] == r["batch"]
                       and x["ctx"] == r["ctx"] and "us" in x), None)
            print(f"{r['batch']:>4} {r['ctx']:>5} {r['num_splits']:>6} {r['us']:>8.1f} {r['gbps']:>7.0f} "
                  f"{r['gbps'] * 1e9 / read_bw:>5.2f} {sd['us'] if sd else float('nan'):>8.1f}")
    sweep = [r for r in rows if r["kernel"] == "decode_attention" and r["variant"] != "default"]
    if sweep:
        print("\ndecode: split count around the default (us)")
        for r in rows:
            if r["kernel"] == "decode_attention" and r["variant"] == "default":
                others = [x for x in sweep if x["batch"] == r["batch"] and x["ctx"] == r["ctx"]]
                if others:
                    print(f"  B={r['batch']:>3} ctx={r['ctx']:>4}: splits {r['num_splits']} {r['us']:.1f}; " +
                          ", ".join(f"splits {x['num_splits']} {x['us']:.1f}" for x in others))
    print("\ndense LoRA (bf16, rank 16 in a rank-64 pool of 8 slots): default config vs the base GEMM")
    print(f"{'proj':>4} {'T':>5} {'pattern':>9} {'us':>8} {'base us':>8} {'ratio':>6}")
    for r in rows:
        if r["kernel"] == "dense_lora" and r["variant"] == "default":
            print(f"{r['proj']:>4} {r['T']:>5} {r['pattern']:>9} {r['us']:>8.1f} {r['base_gemm_us']:>8.1f} "
                  f"{r['ratio_to_base']:>6.2f}")
    lsweep = [r for r in rows if r["kernel"] == "dense_lora" and r["variant"] != "default"]
    if lsweep:
        print("\ndense LoRA (qkv): slot lanes (us)")
        for key in sorted({(r["T"], r["pattern"]) for r in lsweep}):
            print(f"  T={key[0]:>4} {key[1]:>8}: " + ", ".join(
                f"{r['variant']} {r['us']:.1f}" for r in lsweep if (r["T"], r["pattern"]) == key))
    print(f"\n{result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
