"""The fused norm and attention-prologue kernels (kernels/norm_rotary.py) against the torch code they replace.

Part `norm_rotary` of `python -m benchmarks.kernels.kernels --parts norm_rotary`. Per token count: RMSNorm,
residual add + RMSNorm (hidden 2048) and q/k norm + rotary + KV write at three presets' attention shapes,
each as CUDA-graph replays rotating through 4 input sets, fused and torch interleaved (A, B, A, B; medians),
and the kernels one call launches (torch profiler, after every timing).
"""
from __future__ import annotations

import statistics

import torch

from moeserve.bench.common import graph_time_us
from moeserve.bench.layer_profile import kernel_names
from moeserve.kernels import norm_rotary
from moeserve.layers.attention import Attention
from moeserve.layers.batch import AttentionMetadata
from moeserve.layers.norm import RMSNorm
from moeserve.layers.rotary import RotaryEmbedding
from moeserve.model_spec import ModelSpec

TOKENS = (1, 8, 64, 256, 512)
HIDDEN, EPS, BLOCK_SIZE, MAX_POS = 2048, 1e-6, 16, 4096
PROLOGUES = {  # name -> (qk_norm, heads, kv heads, head_dim)
    "qwen3-30b-a3b": ("head", 32, 4, 128),
    "olmoe-1b-7b": ("full", 16, 16, 128),
    "qwen1.5-moe-a2.7b": ("none", 16, 16, 128),
}
NUM_SETS, ROUNDS = 4, 3


def _attention(qk_norm: str, nh: int, nkv: int, d: int, device) -> Attention:
    spec = ModelSpec(family="qwen3_moe", vocab_size=32, hidden_size=HIDDEN, num_layers=1, num_heads=nh,
                     num_kv_heads=nkv, head_dim=d, num_experts=2, top_k=1, moe_intermediate_size=8,
                     intermediate_size=8, norm_topk_prob=True, sparse_layers=(True,), qk_norm=qk_norm,
                     rms_norm_eps=EPS, max_position_embeddings=MAX_POS)
    rotary = RotaryEmbedding(d, MAX_POS, 1e6)
    return Attention(spec, rotary, fused_prologue=True).to(device, torch.bfloat16)


def _interleaved(fused: list, reference: list) -> dict:
    """Median µs per call of each, timed A, B, A, B ... in one process."""
    times = {"fused_us": [], "torch_us": []}
    for _ in range(ROUNDS):
        times["fused_us"].append(graph_time_us(fused))
        times["torch_us"].append(graph_time_us(reference))
    row = {k: statistics.median(v) for k, v in times.items()}
    row["speedup"] = row["torch_us"] / row["fused_us"]
    return row


def _cases(T: int, gen, device) -> dict[str, tuple[list, list]]:
    """case name -> (fused fns, torch fns), one per input set."""
    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16)

    norm = RMSNorm(HIDDEN, EPS).to(device, torch.bfloat16)  # the torch backend's module
    xs = [(randn(T, HIDDEN), randn(T, HIDDEN)) for _ in range(NUM_SETS)]
    cases = {
        "rms_norm": ([lambda x=x: norm_rotary.rms_norm(x, norm.weight, EPS) for x, _ in xs],
                     [lambda x=x: norm(x) for x, _ in xs]),
        "add+rms_norm": ([lambda x=x, r=r: norm_rotary.fused_add_rms_norm(x, r, norm.weight, EPS) for x, r in xs],
                         [lambda x=x, r=r: norm(x, r) for x, r in xs]),
    }
    for name, (qk_norm, nh, nkv, d) in PROLOGUES.items():
        attn = _attention(qk_norm, nh, nkv, d, device)
        fused, reference = [], []
        for _ in range(NUM_SETS):
            qkv = randn(T, (nh + 2 * nkv) * d)
            positions = torch.randint(0, MAX_POS, (T,), generator=gen, device=device)
            blocks = T // BLOCK_SIZE + 2
            slots = BLOCK_SIZE + torch.randperm((blocks - 1) * BLOCK_SIZE, generator=gen, device=device)[:T]
            meta = AttentionMetadata(slots, torch.zeros(1, 1, dtype=torch.int32, device=device),
                                     torch.zeros(1, dtype=torch.int32, device=device), is_decode=True)
            k_cache, v_cache = (torch.zeros(blocks, BLOCK_SIZE, nkv, d, device=device, dtype=torch.bfloat16)
                                for _ in range(2))

            def torch_path(attn=attn, qkv=qkv, positions=positions, meta=meta, k_cache=k_cache, v_cache=v_cache):
                q, k, v = attn.qk_norm_rotary(qkv, positions)
                attn.write_kv(k, v, meta, k_cache, v_cache)
                return q

            fused.append(lambda attn=attn, qkv=qkv, positions=positions, meta=meta, k_cache=k_cache,
                         v_cache=v_cache: attn.qk_norm_rotary_write_kv(qkv, positions, meta, k_cache, v_cache))
            reference.append(torch_path)
        cases[f"prologue {name}"] = (fused, reference)
    return cases


@torch.inference_mode()
def bench_norm_rotary(tokens=TOKENS, device="cuda") -> list[dict]:
    gen = torch.Generator(device).manual_seed(0)
    rows, count_fns = [], {}
    for T in tokens:
        for case, (fused, reference) in _cases(T, gen, device).items():
            row = {"case": case, "tokens": T, **_interleaved(fused, reference)}
            rows.append(row)
            count_fns[(case, T)] = (fused[0], reference[0])
            print(f"  {case:>28} T={T:<4} fused {row['fused_us']:7.1f} us  torch {row['torch_us']:7.1f} us  "
                  f"x{row['speedup']:.2f}", flush=True)
    for row in rows:  # after every timing: the profiler can slow later launches
        fused, reference = count_fns[(row["case"], row["tokens"])]
        names = kernel_names(fused), kernel_names(reference)
        row["fused_kernels"], row["torch_kernels"] = (None if n is None else len(n) for n in names)
    return rows


def print_table(rows: list[dict]) -> None:
    print("\nfused norm / attention prologue vs the torch code it replaces (bf16, CUDA-graph replay, medians)")
    print(f"{'case':>28} {'T':>4} {'fused us':>9} {'torch us':>9} {'speedup':>8} {'kernels':>9}")
    for r in rows:
        kernels = f"{r['fused_kernels']}/{r['torch_kernels']}" if r.get("fused_kernels") is not None else "-"
        print(f"{r['case']:>28} {r['tokens']:>4} {r['fused_us']:9.1f} {r['torch_us']:9.1f} "
              f"{r['speedup']:8.2f} {kernels:>9}")
