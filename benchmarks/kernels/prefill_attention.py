"""Paged prefill attention at Qwen3-30B-A3B shapes, against its compute and bytes floors, with a tile sweep.

    python -m benchmarks.kernels.prefill_attention --out DIR [--sweep] [--cases protocol,long]

The prefill forward's attention was 9.8 of 89.6 ms at 8,192 tokens (`bench prefill --profile`, session 19): ~204
µs a layer for ~17 GFLOP of causal attention (22 µs at 790 TFLOP/s) and ~150 MB of bytes (35 µs). Cases: the
serving protocol's chunk (32 fresh prompts of 256 tokens), 4 prompts of 2,048, one of 8,192, and a 2,048-token chunk
after 6,144 cached. Each timing is a CUDA-graph replay over copies of q and the cache (together past L2), medians of
interleaved rounds; every variant is checked against the default's output. `--sweep` times PrefillTile candidates
(rows, KV tokens per step, warps, stages, the causal mask only where a step needs it). Writes DIR/prefill_attention.json.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch

from moeserve.bench.common import graph_time_us
from moeserve.kernels.paged_attention import PrefillTile, paged_prefill_attention

N_HEADS, N_KV, HEAD_DIM, BLOCK_SIZE = 32, 4, 128, 16
PEAK_TFLOPS, BANDWIDTH = 790.0, 4.3e12  # the project's bf16 matmul peak and the H200's read bandwidth
CASES = {  # name -> [(new tokens, cached tokens before them)] per sequence
    "protocol": [(256, 0)] * 32,
    "2k": [(2048, 0)] * 4,
    "8k": [(8192, 0)],
    "chunk": [(2048, 6144)],
}
ROUNDS = 3
SWEEP = [PrefillTile(m, n, w, st, sc) for m in (64, 128) for n in (64, 128) for w in (4, 8) for st in (2, 3)
         for sc in (False, True)]


def make_case(seqs, copies: int, gen):
    """Copies of (q, k cache, v cache) and the shared (block tables, query starts, sequence lengths)."""
    lens = [new + old for new, old in seqs]
    blocks = [math.ceil(n / BLOCK_SIZE) for n in lens]
    tables = torch.zeros(len(seqs), max(blocks), dtype=torch.int32)
    start = 1  # block 0 stays the dummy block, as in the engine
    for i, b in enumerate(blocks):
        tables[i, :b] = torch.arange(start, start + b)
        start += b
    q_lens = [new for new, _ in seqs]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    data = [(torch.randn(sum(q_lens), N_HEADS, HEAD_DIM, generator=gen, device="cuda").bfloat16(),
             torch.randn(start, BLOCK_SIZE, N_KV, HEAD_DIM, generator=gen, device="cuda").bfloat16(),
             torch.randn(start, BLOCK_SIZE, N_KV, HEAD_DIM, generator=gen, device="cuda").bfloat16())
            for _ in range(copies)]
    return data, tables.cuda(), qsl.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda"), max(q_lens)


def floors_us(seqs) -> tuple[float, float]:
    """(compute floor, bytes floor) in µs: causal QK^T and PV FLOPs at the peak; q read, out written, K/V read once."""
    flops = sum(4 * N_HEADS * HEAD_DIM * new * (old + (new + 1) / 2) for new, old in seqs)
    nbytes = sum(2 * (2 * new * N_HEADS * HEAD_DIM + 2 * (new + old) * N_KV * HEAD_DIM) for new, old in seqs)
    return flops / (PEAK_TFLOPS * 1e12) * 1e6, nbytes / BANDWIDTH * 1e6


def bench_case(name: str, sweep: bool, gen) -> dict:
    seqs = CASES[name]
    new_tokens = sum(new for new, _ in seqs)
    per_copy = 2 * (2 * new_tokens * N_HEADS * HEAD_DIM + 2 * sum(n + o for n, o in seqs) * N_KV * HEAD_DIM)
    data, tables, qsl, sl, max_q = make_case(seqs, max(2, min(8, math.ceil((256 << 20) / per_copy))), gen)
    scale = HEAD_DIM ** -0.5
    # "default": PrefillTile()'s 128 x 64 tile; "shipped": the engine's launch (prefill_tile by the longest query)
    variants = {"default": PrefillTile(), "shipped": None} | ({str(tuple(t)): t for t in SWEEP} if sweep else {})

    def run(tile):
        return [lambda d=d: paged_prefill_attention(d[0], d[1], d[2], tables, qsl, sl, scale, max_q, pdl=True,
                                                     tile=tile) for d in data]

    want = paged_prefill_attention(*data[0], tables, qsl, sl, scale, max_q, tile=PrefillTile()).float()
    times, failed = {k: [] for k in variants}, {}
    for _ in range(ROUNDS):
        for k, tile in variants.items():
            if k in failed:
                continue
            try:
                times[k].append(graph_time_us(run(tile)) / len(data))
            except Exception as exc:  # a candidate that does not fit (shared memory, registers) is reported
                failed[k] = repr(exc)[:200]
    errors = {}
    for k, tile in variants.items():
        if k not in failed:
            got = paged_prefill_attention(*data[0], tables, qsl, sl, scale, max_q, tile=tile).float()
            errors[k] = ((got - want).abs().max() / want.abs().max()).item()
    med = {k: statistics.median(v) for k, v in times.items() if v}
    flops_floor, bytes_floor = floors_us(seqs)
    best = min(med, key=med.get)
    print(f"{name:>8}: {new_tokens} new tokens; default {med['default']:.1f} us, shipped {med['shipped']:.1f} us "
          f"(err {errors['shipped']:.1e}) (compute floor {flops_floor:.1f}, "
          f"bytes floor {bytes_floor:.1f}); best {best} {med[best]:.1f} us (err {errors[best]:.1e})", flush=True)
    if sweep:
        for k in sorted(med, key=med.get)[:8]:
            print(f"          {k}: {med[k]:.1f} us, err {errors[k]:.1e}")
    for k, err in failed.items():
        print(f"          {k} failed: {err}")
    return dict(case=name, seqs=seqs, us=med, errors=errors, failed=failed, compute_floor_us=flops_floor,
                bytes_floor_us=bytes_floor)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out/")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args(argv)
    gen = torch.Generator("cuda").manual_seed(0)
    rows = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.cases.split(","):
        rows.append(bench_case(name, args.sweep, gen))
        (out / "prefill_attention.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
