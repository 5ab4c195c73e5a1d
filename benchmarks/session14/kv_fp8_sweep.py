"""Paged decode attention on an fp8 KV cache against the bf16 one, Qwen3-30B-A3B attention shapes (32 heads, 4 KV
heads, head_dim 128, 16-token blocks, 512-token context), µs per call in a CUDA graph over cache copies (cold L2):
the default tiles (tuned for bf16) and candidates for one-byte K/V rows (longer KV steps, more warps and stages, the
split count around its default). Why: call 3 of session 14 found the fp8 cache's decode step slower than bf16's.

    PYTHONPATH=. python benchmarks/session14/kv_fp8_sweep.py --out DIR
"""
import argparse
import itertools
import json
from pathlib import Path

import torch

from benchmarks.kernels.attention import BLOCK_SIZE, HEAD_DIM, N_KV, copies_for, decode_setup
from moeserve.bench.common import graph_time_us
from moeserve.kernels.kv_fp8 import quantize_kv
from moeserve.kernels.paged_attention import DECODE_BLOCK_N, _launch_decode, default_num_splits

CTX = 512


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="64,256,512")
    ap.add_argument("--more-splits", action="store_true",
                    help="instead: both caches, split counts 1x / 2x / 4x the default (call 6)")
    args = ap.parse_args()
    if args.more_splits:
        return more_splits(args)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for batch in map(int, args.batches.split(",")):
        kv_bytes = batch * CTX * N_KV * HEAD_DIM * 2 * 2
        sets, ctx_lens = decode_setup(batch, CTX, copies_for(kv_bytes), gen)
        fp8_sets = [(q, quantize_kv(k, 1.0), quantize_kv(v, 1.0), t) for q, k, v, t in sets]
        outs = [torch.empty_like(s[0]) for s in sets]
        splits0 = default_num_splits(batch, N_KV, sets[0][3].shape[1], BLOCK_SIZE, torch.device("cuda"))
        scale = HEAD_DIM ** -0.5

        def time_it(cache_sets, splits, block_n, warps, stages):
            fns = [lambda s=s, o=o: _launch_decode(*s, ctx_lens, scale, splits, o, block_n=block_n,
                                                   num_warps=warps, num_stages=stages)
                   for s, o in zip(cache_sets, outs)]
            return graph_time_us(fns)

        base = time_it(sets, splits0, DECODE_BLOCK_N, 4, 2)
        rows.append(dict(batch=batch, cache="bf16", splits=splits0, block_n=DECODE_BLOCK_N, warps=4, stages=2, us=base))
        print(f"B={batch} bf16 default: {base:.1f} us (splits {splits0})", flush=True)
        results = {}
        for block_n, warps, stages, sf in itertools.product((64, 128), (4, 8), (2, 3, 4), (1, 2)):
            splits = max(1, splits0 // sf)
            try:
                us = time_it(fp8_sets, splits, block_n, warps, stages)
            except Exception as exc:  # a tile that does not fit
                print(f"  fp8 {block_n} w{warps} s{stages} splits {splits}: {type(exc).__name__}")
                continue
            results[(block_n, warps, stages, splits)] = us
            rows.append(dict(batch=batch, cache="fp8", splits=splits, block_n=block_n, warps=warps, stages=stages,
                             us=us))
        default = results.get((DECODE_BLOCK_N, 4, 2, splits0))
        best = min(results, key=results.get)
        print(f"B={batch} fp8 default {default:.1f} us ({default / base:.2f} of bf16); best {best} "
              f"{results[best]:.1f} us ({results[best] / base:.2f} of bf16)", flush=True)
        for key in sorted(results, key=results.get)[:5]:
            print(f"   {key}: {results[key]:.1f}")
        del sets, fp8_sets
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "kv_fp8_sweep.json").write_text(json.dumps(rows, indent=1))


def more_splits(args) -> None:
    """bf16 and fp8 caches at 1x, 2x and 4x the default split count (a latency-bound kernel may want more programs in
    flight than three per SM), 64- and 128-token steps, 2-4 stages."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for batch in map(int, args.batches.split(",")):
        kv_bytes = batch * CTX * N_KV * HEAD_DIM * 2 * 2
        sets, ctx_lens = decode_setup(batch, CTX, copies_for(kv_bytes), gen)
        caches = {"bf16": sets, "fp8": [(q, quantize_kv(k, 1.0), quantize_kv(v, 1.0), t) for q, k, v, t in sets]}
        outs = [torch.empty_like(s[0]) for s in sets]
        splits0 = default_num_splits(batch, N_KV, sets[0][3].shape[1], BLOCK_SIZE, torch.device("cuda"))
        for cache, cache_sets in caches.items():
            res = {}
            for block_n, stages, mult in itertools.product((64, 128), (2, 3, 4), (1, 2, 4)):
                splits = splits0 * mult
                fns = [lambda s=s, o=o: _launch_decode(*s, ctx_lens, HEAD_DIM ** -0.5, splits, o, block_n=block_n,
                                                       num_warps=4, num_stages=stages)
                       for s, o in zip(cache_sets, outs)]
                try:
                    res[(block_n, stages, splits)] = graph_time_us(fns)
                except Exception as exc:
                    print(f"  {cache} {block_n} s{stages} splits {splits}: {type(exc).__name__}")
            for key, us in res.items():
                rows.append(dict(batch=batch, cache=cache, block_n=key[0], stages=key[1], splits=key[2], us=us))
            best = sorted(res, key=res.get)[:4]
            print(f"B={batch} {cache}: (64, 2, {splits0}) {res.get((64, 2, splits0), float('nan')):.1f} us; best "
                  + ", ".join(f"{k} {res[k]:.1f}" for k in best), flush=True)
        del sets, caches
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "kv_splits_sweep.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
