"""Session 24: the MoE alignment's launch options at decode sizes (µs per call, one CUDA graph of 16 calls over
16 routings, no PDL): the pairs per placing program (`chunk`) and whether every placing program counts the
histogram itself (`self_count`, one launch) or a count kernel does first (two launches past 1,024 pairs).

    PYTHONPATH=. python benchmarks/session24/align_sweep.py --out DIR
"""
import argparse
import json
import os

import torch

from moeserve.bench.common import graph_time_us
from moeserve.kernels.moe_align import moe_align, moe_align_ref

E, TOP_K = 128, 8


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="16,64,128,256,512,1024")
    ap.add_argument("--out", default="align_out")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator("cuda").manual_seed(0)
    rows = []
    for t in [int(v) for v in args.tokens.split(",")]:
        ids_sets = [torch.rand(t, E, generator=gen, device="cuda").topk(TOP_K, dim=1).indices.int() for _ in range(16)]
        for block_m in (16, 64):
            ref = moe_align_ref(ids_sets[0], E, block_m)
            for chunk in (None, 64, 128, 256, 512, 1024, 4096):
                for self_count in (False, True):
                    if chunk is not None and chunk >= t * TOP_K and self_count:
                        continue  # one chunk: nothing to count apart
                    got = moe_align(ids_sets[0], E, block_m, chunk=chunk, self_count=self_count)
                    ok = torch.equal(got.block_groups, ref.block_groups) and torch.equal(
                        got.sorted_ids.sort().values, ref.sorted_ids.sort().values)
                    us = graph_time_us([lambda i=i: moe_align(i, E, block_m, chunk=chunk, self_count=self_count)
                                        for i in ids_sets])
                    rows.append(dict(tokens=t, block_m=block_m, chunk=chunk, self_count=self_count, us=us, ok=ok))
                    print(f"T {t:>5} bm {block_m:>3} chunk {str(chunk):>5} self {int(self_count)} {us:7.2f} us"
                          f"{'' if ok else '  MISMATCH'}", flush=True)
    json.dump(rows, open(os.path.join(args.out, "align_sweep.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
