"""Session 25: what a dense projection's LoRA expand would cost as K columns of the base GEMM itself (#24).

The bf16 step at B = 256 / 512 spends ~7 / ~9 us a layer on the q|k|v and o expands (one launch each, after the
cuBLAS GEMM). With the shrink writing s [T, L*R] (each row's rank columns in its slot's place, zeros elsewhere)
beside the GEMM's input, and each slot's B [N, R] beside W, one GEMM computes x W^T + s B^T: the expand becomes
L*R more K columns of a GEMM that already runs. Whether cuBLAS keeps its speed on that shape, and on the strided
views the LoRA-free graph would read (x and W as the first K columns of the wider buffers), is what this times:
per (projection, T), F.linear on the plain operands, on the strided views, and on the concatenated ones (K + 64:
4 rank-16 slots; K + 512: 8 rank-64 slots), with the separate expand (a second GEMM adding s B^T, torch's addmm)
for comparison. CUDA-graph replays over 16 weight copies (out of L2), medians of 3 interleaved rounds.

    PYTHONPATH=. python benchmarks/session25/concat_k.py --out DIR
"""
import argparse
import json
import os

import torch

from benchmarks.kernels.fp8_moe import time_interleaved

SHAPES = {"qkv": (5120, 2048), "o": (2048, 4096)}  # name -> (out, in), Qwen3-30B-A3B
SETS = 16


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="64,256,512")
    ap.add_argument("--extra", default="64,512", help="LoRA K columns: max_loras x max rank")
    ap.add_argument("--out", default="concat_out")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    g = torch.Generator("cuda").manual_seed(0)
    rnd = lambda *s: (torch.randn(*s, device="cuda", generator=g) * 0.02).bfloat16()  # noqa: E731
    report = []
    for name, (n, k) in SHAPES.items():
        for extra in [int(v) for v in args.extra.split(",")]:
            wide = [rnd(n, k + extra) for _ in range(SETS)]
            for t in [int(v) for v in args.tokens.split(",")]:
                xs = [rnd(t, k + extra) for _ in range(SETS)]
                plain_w = [w[:, :k].contiguous() for w in wide]
                plain_x = [x[:, :k].contiguous() for x in xs]
                outs = [torch.empty(t, n, device="cuda", dtype=torch.bfloat16) for _ in range(SETS)]
                s_b = [(x[:, k:].contiguous(), w[:, k:].contiguous()) for x, w in zip(xs, wide)]

                def expand_after(i):
                    torch.matmul(plain_x[i], plain_w[i].t(), out=outs[i])
                    outs[i].addmm_(s_b[i][0], s_b[i][1].t())

                fns = {
                    "plain": [lambda i=i: torch.matmul(plain_x[i], plain_w[i].t(), out=outs[i]) for i in range(SETS)],
                    "strided views": [lambda i=i: torch.matmul(xs[i][:, :k], wide[i][:, :k].t(), out=outs[i])
                                      for i in range(SETS)],
                    "concatenated": [lambda i=i: torch.matmul(xs[i], wide[i].t(), out=outs[i]) for i in range(SETS)],
                    "plain + addmm expand": [lambda i=i: expand_after(i) for i in range(SETS)],
                }
                times = time_interleaved(fns, 3)
                base = times["plain"]
                line = " ".join(f"{v}: {times[v]:.2f}" if not isinstance(times[v], str) else f"{v}: {times[v]}"
                                for v in fns)
                print(f"{name} T {t:>4} +K {extra:>3} | {line} | concat/plain {times['concatenated'] / base:.3f}",
                      flush=True)
                report.append(dict(proj=name, tokens=t, extra_k=extra, **times))
                del xs, plain_x, plain_w, outs, s_b
            del wide
            torch.cuda.empty_cache()
    json.dump(report, open(os.path.join(args.out, "concat_k.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
