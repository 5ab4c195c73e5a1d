"""Paged decode attention at Qwen3-30B-A3B shapes (dense multi-LoRA: `benchmarks.kernels.kernels --parts dense_lora`).

    python -m benchmarks.kernels.attention --out DIR [--quick]

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
from moeserve.kernels.paged_attention import (
    DECODE_BLOCK_N,
    _launch_decode,
    default_num_splits,
    paged_decode_attention,
)

N_HEADS, N_KV, HEAD_DIM, HIDDEN = 32, 4, 128, 2048
BLOCK_SIZE, MAX_MODEL_LEN = 16, 4096
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


# Tile configs were swept once (block_n 32/64/128 x warps 4/8 x stages 2/3): the defaults were best or within
# 3 %. What stays swept: the split count around its default.
DECODE_SWEEP = [dict(name="splits_x0.5", num_splits=-1), dict(name="splits_x2", num_splits=-2)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".")
    parser.add_argument("--quick", action="store_true", help="default configs only, no sweeps")
    args = parser.parse_args(argv)
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
    print(f"\n{result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
