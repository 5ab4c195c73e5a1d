"""Paged decode attention at Qwen3-30B-A3B shapes (dense multi-LoRA: `bench kernels --parts dense_lora`).

    python -m moeserve.bench.attention --out DIR [--quick]

The split merge, fused into the split kernel vs the separate merge kernel, is `bench kernels --parts attention`
(`merge_rows` / `print_merge_table` here).

Every timing is a CUDA-graph replay of many calls (launch overhead as in graph decode), each
call on a different copy of the data, with the copies together far larger than L2, as when
48 layers run between two calls of one layer. Prints tables; writes DIR/attention_bench.json.
Bandwidth efficiency is against the copy bandwidth (read + write) measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from moeserve.bench.common import bandwidths, graph_time_us
from moeserve.kernels.paged_attention import (
    DECODE_BLOCK_N,
    _launch_decode,
    decode_counter_slots,
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


# ----------------------------------------------------------------------------- split merge: fused vs two kernels

MERGE_BATCHES = (1, 2, 4, 8, 64, 256)
MERGE_CONTEXTS = (512, 2048)
MERGE_ROUNDS = 5  # interleaved repeats of (fused, two kernels)


def active_splits(ctx: int, splits: int, block_n: int = DECODE_BLOCK_N) -> int:
    """Splits that hold KV tiles at this context (the rest exit at once)."""
    tiles = math.ceil(ctx / block_n)
    return math.ceil(tiles / math.ceil(tiles / splits))


def bench_merge(batch: int, ctx: int, gen) -> dict:
    """Default-split decode with the merge in the split kernel vs in the merge kernel: medians of µs per call over
    MERGE_ROUNDS interleaved rounds of CUDA-graph replays, and whether the two outputs are bitwise equal."""
    kv_bytes = batch * ctx * N_KV * HEAD_DIM * 2 * 2
    sets, ctx_lens = decode_setup(batch, ctx, copies_for(kv_bytes), gen)
    scale = HEAD_DIM**-0.5
    outs = [torch.empty_like(s[0]) for s in sets]
    counters = torch.zeros(decode_counter_slots(batch, N_KV), dtype=torch.int32, device="cuda")
    splits = default_num_splits(batch, N_KV, sets[0][3].shape[1], BLOCK_SIZE, torch.device("cuda"))
    modes = {"fused": dict(fused_merge=True, counters=counters), "two_kernel": dict(fused_merge=False)}
    results = {name: paged_decode_attention(*sets[0][:4], ctx_lens, scale, **kw) for name, kw in modes.items()}
    times = {name: [] for name in modes}
    for _ in range(MERGE_ROUNDS):
        for name, kw in modes.items():
            times[name].append(graph_time_us(
                [lambda s=s, o=o, kw=kw: paged_decode_attention(*s[:4], ctx_lens, scale, out=o, **kw)
                 for s, o in zip(sets, outs)]))
    del sets
    us = {name: statistics.median(t) for name, t in times.items()}
    return dict(batch=batch, ctx=ctx, num_splits=splits, active_splits=active_splits(ctx, splits),
                kv_bytes=kv_bytes, fused_us=us["fused"], two_kernel_us=us["two_kernel"],
                bitwise_equal=bool(torch.equal(results["fused"], results["two_kernel"])),
                counters_zero=not bool(counters.any()))


def merge_rows(gen, save=None) -> list[dict]:
    rows = []
    for batch in MERGE_BATCHES:
        for ctx in MERGE_CONTEXTS:
            rows.append(bench_merge(batch, ctx, gen))
            if save is not None:
                save(rows)
            r = rows[-1]
            print(f"decode merge B={batch} ctx={ctx}: fused {r['fused_us']:.1f} us, two kernels "
                  f"{r['two_kernel_us']:.1f} us", flush=True)
    return rows


def print_merge_table(rows: list[dict], read_gbps: float | None = None) -> None:
    print(f"\ndecode attention, split merge fused into the split kernel vs the merge kernel (bf16, {N_HEADS} q / {N_KV} "
          f"kv heads x {HEAD_DIM}, block {BLOCK_SIZE}, default splits; CUDA-graph replays over copies >> L2, medians "
          f"of {MERGE_ROUNDS} interleaved rounds); active = splits holding KV tiles at this context")
    floor = f" {'floor us':>8}" if read_gbps else ""
    print(f"{'B':>4} {'ctx':>5} {'splits':>6} {'active':>6} {'fused us':>9} {'2-kernel us':>11} {'ratio':>6} "
          f"{'bitwise':>7}{floor}")
    for r in rows:
        cell = f" {r['kv_bytes'] / (read_gbps * 1e3):>8.2f}" if read_gbps else ""
        print(f"{r['batch']:>4} {r['ctx']:>5} {r['num_splits']:>6} {r['active_splits']:>6} {r['fused_us']:>9.2f} "
              f"{r['two_kernel_us']:>11.2f} {r['fused_us'] / r['two_kernel_us']:>6.3f} "
              f"{'yes' if r['bitwise_equal'] and r['counters_zero'] else 'NO':>7}{cell}")


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
