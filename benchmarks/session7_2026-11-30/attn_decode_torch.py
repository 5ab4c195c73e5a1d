"""Torch reference decode attention, before (K/V repeated per query head) and after (queries grouped by KV head):
ms per call, 2 threads, A, B, A, B. python benchmarks/session7_2026-11-30/attn_decode_torch.py [out.json]"""
import json, sys, time
import torch
from types import SimpleNamespace
import torch.nn.functional as F
torch.set_num_threads(2)
def old(q, k_cache, v_cache, meta, scale):
    nh = q.shape[1]; nkv = k_cache.shape[2]
    k = k_cache[meta.block_tables].flatten(1, 2); v = v_cache[meta.block_tables].flatten(1, 2)
    ctx = k.shape[1]
    valid = torch.arange(ctx)[None, :] < meta.context_lens[:, None]
    k = k.repeat_interleave(nh // nkv, dim=2).transpose(1, 2); v = v.repeat_interleave(nh // nkv, dim=2).transpose(1, 2)
    scores = torch.einsum("bhd,bhcd->bhc", q.float(), k.float()) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhc,bhcd->bhd", probs, v.float()).to(q.dtype)
from moeserve.layers.attention import TorchAttentionBackend
new = TorchAttentionBackend().decode
rows = []
for B, blocks in [(64, 8), (64, 32), (8, 8), (1, 8), (64, 128)]:
    bs, nh, nkv, d = 16, 9, 3, 64
    kc = torch.randn(B * blocks + 1, bs, nkv, d); vc = torch.randn_like(kc)
    bt = torch.arange(1, B * blocks + 1).view(B, blocks)
    meta = SimpleNamespace(block_tables=bt, context_lens=torch.randint(1, blocks * bs, (B,)))
    q = torch.randn(B, nh, d)
    a, b = old(q, kc, vc, meta, 0.125), new(q, kc, vc, meta, 0.125)
    res = {}
    for name, fn in [("old", old), ("new", new)] * 2:
        t0 = time.perf_counter()
        for _ in range(50): fn(q, kc, vc, meta, 0.125)
        res.setdefault(name, []).append((time.perf_counter() - t0) / 50 * 1e3)
    rows.append({"batch": B, "context": blocks * bs, "ms": res, "max_abs_diff": (a - b).abs().max().item()})
    print(B, blocks * bs, {k: [round(x, 3) for x in v] for k, v in res.items()}, "maxdiff", rows[-1]["max_abs_diff"])
if len(sys.argv) > 1:
    json.dump(rows, open(sys.argv[1], "w"), indent=1)
