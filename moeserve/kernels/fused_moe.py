"""Fused MoE forward (routed experts, SiLU-gated) with optional per-token LoRA on the experts.

    out[t] = sum_k w[t,k] * (W2_e @ h + dD),   e = topk_ids[t,k]
    h = silu(g) * u,  [g | u] = W13_e @ x_t + dGU
    dGU = [Bg[s,e] @ (Ag[s,e] @ x_t) | Bu[s,e] @ (Au[s,e] @ x_t)],  dD = B2[s,e] @ (A2[s,e] @ h)
    (s = the token's adapter slot; gate and up have an A each, rank r each)

Two paths, chosen from the number of (token, k) pairs only (so a CUDA graph of a batch
size always records the same kernels):

- decode (few pairs): no alignment. GEMV-style programs, one per (pair, N tile), read the
  pair's expert rows directly.
- sorted (many pairs): pairs are aligned into blocks of one expert (moe_align) -- with LoRA,
  of one (expert, adapter slot) group -- then two grouped GEMMs: gate_up -> [pairs, 2I], and
  down with SiLU*up fused into its A-operand load, routing weight applied in the epilogue.

The expert LoRA lives inside these four kernels: the shrink (A @ activation) runs in the base
K loop on the activation tiles it loads anyway, the expand (B @ shrunk) in the epilogue,
before the activation (gate_up) or the routing weight (down). So LoRA adds no launch but the
(expert, slot) alignment. Both paths end with a top-k sum over fp32 per-pair outputs (no
atomics). `lora=None` launches no LoRA work at all. No host syncs anywhere: every buffer and
grid is sized from shapes, and inactive rows (slot -1, rank 0, padding) exit or are masked
inside the kernels.
"""

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moeserve.kernels.moe_align import moe_align


@dataclass(frozen=True)
class MoELoRAArgs:
    token_slots: torch.Tensor  # [T] int32, adapter slot of each token, -1 = no adapter
    slot_ranks: torch.Tensor  # [L] int32, rank of each slot (0 = empty); columns >= rank are zero
    gate_up_a: torch.Tensor  # [L, E, 2, R, H]: [:, :, 0] A of the gate rows, [:, :, 1] of the up rows
    gate_up_b: torch.Tensor  # [L, E, 2I, R]  (LoRA scaling folded in)
    down_a: torch.Tensor  # [L, E, R, I]
    down_b: torch.Tensor  # [L, E, H, R]


@dataclass(frozen=True)
class GemmTile:
    block_m: int = 16  # sorted path only
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class MoEPlan:
    decode: bool
    gate_up: GemmTile
    down: GemmTile
    lora_rank_block: int = 16  # LoRA rank columns per tile; a slot's rank decides how many tiles run


# Pairs at or below this run the alignment-free GEMV path (H200, Qwen3-30B-A3B shapes:
# GEMV wins up to T=8 at top-8, the sorted path from T=16).
DECODE_MAX_PAIRS = 64


def default_plan(num_tokens: int, top_k: int, decode: bool | None = None) -> MoEPlan:
    """Block sizes by problem size: a static table from the H200 sweep of
    `python -m moeserve.bench.kernels --sweep`. `decode` forces a path. The plan does not depend
    on LoRA: the LoRA variant runs the base math with the same tiles, so rows without an
    adapter stay bitwise the no-LoRA result. (With LoRA, a sorted block holds one (expert, slot)
    group, so tall blocks pad more: the sweep times each tile with and without 4 adapters.)"""
    num_pairs = num_tokens * top_k
    if decode is None:
        decode = num_pairs <= DECODE_MAX_PAIRS
    if decode:
        tile = (GemmTile(block_n=16, block_k=256, num_warps=4, num_stages=1) if num_pairs <= 16
                else GemmTile(block_n=32, block_k=128, num_warps=4, num_stages=1))
        return MoEPlan(True, tile, tile)
    if num_pairs <= 2048:  # few rows per expert: short blocks, wide N tiles
        tile = GemmTile(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=3)
        return MoEPlan(False, tile, tile)
    return MoEPlan(False, GemmTile(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3),
                   GemmTile(block_m=64, block_n=256, block_k=64, num_warps=8, num_stages=3))


# ---------------------------------------------------------------------------------------------
# kernels
#
# LoRA inside the base kernels (HAS_LORA): a program serves one adapter slot (a sorted block is
# one (expert, slot) group; a GEMV program one pair), so it reads one A [rank, K] and one
# B [n tile, rank]. The first BLOCK_R rank columns are shrunk inside the base K loop from the
# activation tiles it already loads; ranks beyond BLOCK_R (rank read in-kernel) run a trailing
# loop that reads the activations again. Programs whose slot is -1 or of rank 0 load nothing
# (masked) and skip the epilogue add, so their rows are bitwise the base result. The gate_up
# A has a gate half and an up half (stride_ah): an N tile lies in one half, since I is a
# multiple of the gate_up BLOCK_N (_fit_gate_up_tile).


@triton.jit
def _silu_mul(gate, up):
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _lora_slot(group, groups_per_expert, ranks_ptr):
    """(slot, rank) of a sorted block's group; rank 0 for the group of pairs without adapter."""
    slot = group % groups_per_expert - 1
    rank = tl.load(ranks_ptr + tl.maximum(slot, 0))
    return slot, tl.where(slot >= 0, rank, 0)


@triton.jit
def _token_slot(slots_ptr, ranks_ptr, token):
    slot = tl.load(slots_ptr + token).to(tl.int32)
    rank = tl.load(ranks_ptr + tl.maximum(slot, 0))
    return slot, tl.where(slot >= 0, rank, 0)


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, w_ptr, gu_ptr, sorted_ids_ptr, block_groups_ptr,
    ranks_ptr, lora_a_ptr, lora_b_ptr,
    num_pairs, top_k, N, K, groups_per_expert,
    stride_xt, stride_we, stride_wn, stride_gu,
    stride_al, stride_ae, stride_ah, stride_ar, stride_bl, stride_be, stride_bn,
    HAS_LORA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr, EVEN_K: tl.constexpr,
):
    """gu[pair] = W13_e @ x[token] (+ B (A x)) for the BLOCK_M pairs of one aligned block, one N tile."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    group = tl.load(block_groups_ptr + pid_m)
    if group < 0:
        return
    expert = group // groups_per_expert
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :]
    b_ptrs = w_ptr + expert.to(tl.int64) * stride_we + rows[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HAS_LORA:
        slot, rank = _lora_slot(group, groups_per_expert, ranks_ptr)
        half = (pid_n * BLOCK_N >= N // 2).to(tl.int64)
        la_base = (lora_a_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_al
                   + expert.to(tl.int64) * stride_ae + half * stride_ah)
        lb_ptrs = (lora_b_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bl
                   + expert.to(tl.int64) * stride_be + rows[None, :] * stride_bn)
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < rank
        la_ptrs = la_base + offs_r[None, :] * stride_ar + offs_k[:, None]
        shrunk = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=pair_ok[:, None], other=0.0)
            b = tl.load(b_ptrs)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a, b.to(a.dtype), acc)
        if HAS_LORA:
            if EVEN_K:
                la = tl.load(la_ptrs, mask=r_ok[None, :], other=0.0)
            else:
                la = tl.load(la_ptrs, mask=r_ok[None, :] & k_ok[:, None], other=0.0)
            shrunk = tl.dot(a, la.to(a.dtype), shrunk)
            la_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_LORA:
        if rank > 0:
            dtype = x_ptr.dtype.element_ty
            lb = tl.load(lb_ptrs + offs_r[:, None], mask=r_ok[:, None], other=0.0)
            acc += tl.dot(shrunk.to(dtype), lb.to(dtype))
            for r0 in range(BLOCK_R, rank, BLOCK_R):  # rank tiles past the first: read x again
                offs_rr = r0 + offs_r
                rr_ok = offs_rr < rank
                xs_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :]
                las_ptrs = la_base + offs_rr[None, :] * stride_ar + offs_k[:, None]
                part = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    k_ok = offs_k < K - k0
                    xa = tl.load(xs_ptrs, mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
                    la = tl.load(las_ptrs, mask=rr_ok[None, :] & k_ok[:, None], other=0.0)
                    part = tl.dot(xa, la.to(xa.dtype), part)
                    xs_ptrs += BLOCK_K
                    las_ptrs += BLOCK_K
                lb = tl.load(lb_ptrs + offs_rr[:, None], mask=rr_ok[:, None], other=0.0)
                acc += tl.dot(part.to(dtype), lb.to(dtype))
    out_ptrs = gu_ptr + pairs.to(tl.int64)[:, None] * stride_gu + offs_n[None, :]
    tl.store(out_ptrs, acc.to(gu_ptr.dtype.element_ty),
             mask=pair_ok[:, None] & (offs_n < N)[None, :])


@triton.jit
def _act_tile(gate_ptrs, K, mask, dtype: tl.constexpr):
    """silu(g) * u of a [rows, BLOCK_K] tile of gu (rows [g | u]), as the down GEMM's A operand."""
    gate = tl.load(gate_ptrs, mask=mask, other=0.0)
    up = tl.load(gate_ptrs + K, mask=mask, other=0.0)
    return _silu_mul(gate.to(tl.float32), up.to(tl.float32)).to(dtype)


@triton.jit
def _moe_down_kernel(
    gu_ptr, w_ptr, y_ptr, topk_weights_ptr, sorted_ids_ptr, block_groups_ptr,
    ranks_ptr, lora_a_ptr, lora_b_ptr,
    num_pairs, N, K, groups_per_expert,
    stride_gu, stride_we, stride_wn, stride_y,
    stride_al, stride_ae, stride_ar, stride_bl, stride_be, stride_bn,
    HAS_LORA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr, EVEN_K: tl.constexpr,
):
    """y[pair] = w[pair] * (W2_e @ h (+ B (A h))), h = silu(g) * u applied as the A tile is loaded."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    group = tl.load(block_groups_ptr + pid_m)
    if group < 0:
        return
    expert = group // groups_per_expert
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pairs < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    gate_ptrs = gu_ptr + pairs.to(tl.int64)[:, None] * stride_gu + offs_k[None, :]
    b_ptrs = w_ptr + expert.to(tl.int64) * stride_we + rows[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HAS_LORA:
        slot, rank = _lora_slot(group, groups_per_expert, ranks_ptr)
        la_base = (lora_a_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_al
                   + expert.to(tl.int64) * stride_ae)
        lb_ptrs = (lora_b_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bl
                   + expert.to(tl.int64) * stride_be + rows[None, :] * stride_bn)
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < rank
        la_ptrs = la_base + offs_r[None, :] * stride_ar + offs_k[:, None]
        shrunk = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            b = tl.load(b_ptrs)
            a = _act_tile(gate_ptrs, K, pair_ok[:, None], b.dtype)
        else:
            k_ok = offs_k < K - k0
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
            a = _act_tile(gate_ptrs, K, pair_ok[:, None] & k_ok[None, :], b.dtype)
        acc = tl.dot(a, b, acc)
        if HAS_LORA:
            if EVEN_K:
                la = tl.load(la_ptrs, mask=r_ok[None, :], other=0.0)
            else:
                la = tl.load(la_ptrs, mask=r_ok[None, :] & k_ok[:, None], other=0.0)
            shrunk = tl.dot(a, la.to(a.dtype), shrunk)
            la_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_LORA:
        if rank > 0:
            dtype = w_ptr.dtype.element_ty
            lb = tl.load(lb_ptrs + offs_r[:, None], mask=r_ok[:, None], other=0.0)
            acc += tl.dot(shrunk.to(dtype), lb.to(dtype))
            for r0 in range(BLOCK_R, rank, BLOCK_R):  # rank tiles past the first: recompute h
                offs_rr = r0 + offs_r
                rr_ok = offs_rr < rank
                hs_ptrs = gu_ptr + pairs.to(tl.int64)[:, None] * stride_gu + offs_k[None, :]
                las_ptrs = la_base + offs_rr[None, :] * stride_ar + offs_k[:, None]
                part = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    k_ok = offs_k < K - k0
                    h = _act_tile(hs_ptrs, K, pair_ok[:, None] & k_ok[None, :], dtype)
                    la = tl.load(las_ptrs, mask=rr_ok[None, :] & k_ok[:, None], other=0.0)
                    part = tl.dot(h, la.to(dtype), part)
                    hs_ptrs += BLOCK_K
                    las_ptrs += BLOCK_K
                lb = tl.load(lb_ptrs + offs_rr[:, None], mask=rr_ok[:, None], other=0.0)
                acc += tl.dot(part.to(dtype), lb.to(dtype))
    weights = tl.load(topk_weights_ptr + pairs, mask=pair_ok, other=0.0).to(tl.float32)
    acc = acc * weights[:, None]
    out_ptrs = y_ptr + pairs.to(tl.int64)[:, None] * stride_y + offs_n[None, :]
    tl.store(out_ptrs, acc, mask=pair_ok[:, None] & (offs_n < N)[None, :])


@triton.jit
def _gemv_gate_up_kernel(
    x_ptr, w_ptr, gu_ptr, topk_ids_ptr,
    slots_ptr, ranks_ptr, lora_a_ptr, lora_b_ptr,
    num_experts, top_k, N, K,
    stride_xt, stride_we, stride_wn, stride_gu,
    stride_al, stride_ae, stride_ah, stride_ar, stride_bl, stride_be, stride_bn,
    HAS_LORA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr, EVEN_K: tl.constexpr,
):
    """gu[pair, tile] = W13_e[tile] @ x[token] (+ B (A x)), fp32; one program per (pair, tile)."""
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(topk_ids_ptr + pair).to(tl.int32)
    if (expert < 0) | (expert >= num_experts):
        return
    token = pair // top_k
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + rows[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + token.to(tl.int64) * stride_xt + offs_k
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if HAS_LORA:
        slot, rank = _token_slot(slots_ptr, ranks_ptr, token)
        half = (pid_n * BLOCK_N >= N // 2).to(tl.int64)
        la_base = (lora_a_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_al
                   + expert.to(tl.int64) * stride_ae + half * stride_ah)
        lb_ptrs = (lora_b_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bl
                   + expert.to(tl.int64) * stride_be + rows[:, None] * stride_bn)
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < rank
        la_ptrs = la_base + offs_r[:, None] * stride_ar + offs_k[None, :]
        lb = tl.load(lb_ptrs + offs_r[None, :], mask=r_ok[None, :], other=0.0)  # overlaps the K loop
        shrunk = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs)
            xv = tl.load(x_ptrs).to(tl.float32)
        else:
            k_ok = offs_k < K - k0
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
            xv = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * xv[None, :]
        if HAS_LORA:
            if EVEN_K:
                la = tl.load(la_ptrs, mask=r_ok[:, None], other=0.0)
            else:
                la = tl.load(la_ptrs, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            shrunk += la.to(tl.float32) * xv[None, :]
            la_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out = tl.sum(acc, 1)
    if HAS_LORA:
        if rank > 0:
            out += tl.sum(lb.to(tl.float32) * tl.sum(shrunk, 1)[None, :], 1)
            for r0 in range(BLOCK_R, rank, BLOCK_R):  # rank tiles past the first: read x again
                offs_rr = r0 + offs_r
                rr_ok = offs_rr < rank
                xs_ptrs = x_ptr + token.to(tl.int64) * stride_xt + offs_k
                las_ptrs = la_base + offs_rr[:, None] * stride_ar + offs_k[None, :]
                part = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    k_ok = offs_k < K - k0
                    xv = tl.load(xs_ptrs, mask=k_ok, other=0.0).to(tl.float32)
                    la = tl.load(las_ptrs, mask=rr_ok[:, None] & k_ok[None, :], other=0.0)
                    part += la.to(tl.float32) * xv[None, :]
                    xs_ptrs += BLOCK_K
                    las_ptrs += BLOCK_K
                lb = tl.load(lb_ptrs + offs_rr[None, :], mask=rr_ok[None, :], other=0.0)
                out += tl.sum(lb.to(tl.float32) * tl.sum(part, 1)[None, :], 1)
    tl.store(gu_ptr + pair.to(tl.int64) * stride_gu + offs_n, out, mask=offs_n < N)


@triton.jit
def _gemv_down_kernel(
    gu_ptr, w_ptr, y_ptr, topk_weights_ptr, topk_ids_ptr,
    slots_ptr, ranks_ptr, lora_a_ptr, lora_b_ptr,
    num_experts, top_k, N, K,
    stride_gu, stride_we, stride_wn, stride_y,
    stride_al, stride_ae, stride_ar, stride_bl, stride_be, stride_bn,
    HAS_LORA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr, EVEN_K: tl.constexpr,
):
    """y[pair, tile] = w[pair] * (W2_e[tile] @ h (+ B (A h))), h = silu(g) * u, fp32."""
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(topk_ids_ptr + pair).to(tl.int32)
    if (expert < 0) | (expert >= num_experts):
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + rows[:, None] * stride_wn + offs_k[None, :]
    gate_ptrs = gu_ptr + pair.to(tl.int64) * stride_gu + offs_k
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if HAS_LORA:
        slot, rank = _token_slot(slots_ptr, ranks_ptr, pair // top_k)
        la_base = (lora_a_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_al
                   + expert.to(tl.int64) * stride_ae)
        lb_ptrs = (lora_b_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bl
                   + expert.to(tl.int64) * stride_be + rows[:, None] * stride_bn)
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < rank
        la_ptrs = la_base + offs_r[:, None] * stride_ar + offs_k[None, :]
        lb = tl.load(lb_ptrs + offs_r[None, :], mask=r_ok[None, :], other=0.0)
        shrunk = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs)
            gate = tl.load(gate_ptrs)
            up = tl.load(gate_ptrs + K)
        else:
            k_ok = offs_k < K - k0
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
            gate = tl.load(gate_ptrs, mask=k_ok, other=0.0)
            up = tl.load(gate_ptrs + K, mask=k_ok, other=0.0)
        h = _silu_mul(gate, up)
        acc += w.to(tl.float32) * h[None, :]
        if HAS_LORA:
            if EVEN_K:
                la = tl.load(la_ptrs, mask=r_ok[:, None], other=0.0)
            else:
                la = tl.load(la_ptrs, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            shrunk += la.to(tl.float32) * h[None, :]
            la_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
    out = tl.sum(acc, 1)
    if HAS_LORA:
        if rank > 0:
            out += tl.sum(lb.to(tl.float32) * tl.sum(shrunk, 1)[None, :], 1)
            for r0 in range(BLOCK_R, rank, BLOCK_R):  # rank tiles past the first: recompute h
                offs_rr = r0 + offs_r
                rr_ok = offs_rr < rank
                hs_ptrs = gu_ptr + pair.to(tl.int64) * stride_gu + offs_k
                las_ptrs = la_base + offs_rr[:, None] * stride_ar + offs_k[None, :]
                part = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    k_ok = offs_k < K - k0
                    gate = tl.load(hs_ptrs, mask=k_ok, other=0.0)
                    up = tl.load(hs_ptrs + K, mask=k_ok, other=0.0)
                    la = tl.load(las_ptrs, mask=rr_ok[:, None] & k_ok[None, :], other=0.0)
                    part += la.to(tl.float32) * _silu_mul(gate, up)[None, :]
                    hs_ptrs += BLOCK_K
                    las_ptrs += BLOCK_K
                lb = tl.load(lb_ptrs + offs_rr[None, :], mask=rr_ok[None, :], other=0.0)
                out += tl.sum(lb.to(tl.float32) * tl.sum(part, 1)[None, :], 1)
    out = out * tl.load(topk_weights_ptr + pair).to(tl.float32)
    tl.store(y_ptr + pair.to(tl.int64) * stride_y + offs_n, out, mask=offs_n < N)


@triton.jit
def _topk_sum_kernel(
    y_ptr, topk_ids_ptr, out_ptr, num_experts, top_k, N, stride_y, stride_out,
    BLOCK_N: tl.constexpr,
):
    """out[t] = sum_k y[t*K + k] over pairs with a valid expert (others were never written)."""
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in range(0, top_k):
        pair = token * top_k + k
        expert = tl.load(topk_ids_ptr + pair + offs_n * 0)  # broadcast: one mask dtype everywhere
        ok = n_ok & (expert >= 0) & (expert < num_experts)
        acc += tl.load(y_ptr + pair.to(tl.int64) * stride_y + offs_n, mask=ok, other=0.0)
    tl.store(out_ptr + token.to(tl.int64) * stride_out + offs_n,
             acc.to(out_ptr.dtype.element_ty), mask=n_ok)


# ---------------------------------------------------------------------------------------------
# launchers


def _topk_sum(y: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, out_dtype) -> torch.Tensor:
    num_tokens, top_k = topk_ids.shape
    n = y.shape[1]
    out = torch.empty(num_tokens, n, dtype=out_dtype, device=y.device)
    block_n = min(1024, triton.next_power_of_2(n))
    _topk_sum_kernel[(num_tokens, triton.cdiv(n, block_n))](
        y, topk_ids, out, num_experts, top_k, n, y.stride(0), out.stride(0),
        BLOCK_N=block_n, num_warps=4)
    return out


def _fit_gate_up_tile(tile: GemmTile, inter: int) -> GemmTile:
    """An N tile of gate_up must lie in the gate half or the up half (its LoRA reads that half's
    A): block_n halves until it divides I. Real shapes (I a multiple of 128) keep their tile; with
    or without LoRA the same tile, so rows without an adapter stay bitwise the base result."""
    block_n = tile.block_n
    while inter % block_n and block_n > 1:
        block_n //= 2
    return tile if block_n == tile.block_n else replace(tile, block_n=block_n)


def _lora_operands(lora: MoELoRAArgs | None, dummy: torch.Tensor):
    """Kernel arguments of the LoRA buffers: (gate_up ptrs, gate_up strides, down ptrs, down
    strides); placeholders without LoRA."""
    if lora is None:
        return (dummy, dummy), (0,) * 7, (dummy, dummy), (0,) * 6
    ga, gb, da, db = lora.gate_up_a, lora.gate_up_b, lora.down_a, lora.down_b
    if ga.dim() != 5 or any(t.stride(-1) != 1 for t in (ga, gb, da, db)):
        raise ValueError("expert LoRA buffers: gate_up_a must be [L, E, 2, R, H] and every buffer "
                         "contiguous in its last dim")
    return ((ga, gb), (*ga.stride()[:4], *gb.stride()[:3]),
            (da, db), (*da.stride()[:3], *db.stride()[:3]))


def _decode_forward(x, w13, w2, topk_weights, topk_ids, lora, plan: MoEPlan):
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    dev = x.device
    has_lora = lora is not None
    slots = (lora.token_slots, lora.slot_ranks) if has_lora else (topk_ids, topk_ids)
    gu_lora, gu_strides, d_lora, d_strides = _lora_operands(lora, x)

    gu = torch.empty(num_pairs, two_i, dtype=torch.float32, device=dev)
    t = _fit_gate_up_tile(plan.gate_up, inter)
    _gemv_gate_up_kernel[(num_pairs, triton.cdiv(two_i, t.block_n))](
        x, w13, gu, topk_ids, *slots, *gu_lora,
        num_experts, top_k, two_i, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), gu.stride(0), *gu_strides,
        HAS_LORA=has_lora, BLOCK_N=t.block_n, BLOCK_K=t.block_k, BLOCK_R=plan.lora_rank_block,
        EVEN_K=hidden % t.block_k == 0, num_warps=t.num_warps, num_stages=t.num_stages)

    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=dev)
    t = plan.down
    _gemv_down_kernel[(num_pairs, triton.cdiv(hidden, t.block_n))](
        gu, w2, y, topk_weights, topk_ids, *slots, *d_lora,
        num_experts, top_k, hidden, inter,
        gu.stride(0), w2.stride(0), w2.stride(1), y.stride(0), *d_strides,
        HAS_LORA=has_lora, BLOCK_N=t.block_n, BLOCK_K=t.block_k, BLOCK_R=plan.lora_rank_block,
        EVEN_K=inter % t.block_k == 0, num_warps=t.num_warps, num_stages=t.num_stages)
    return _topk_sum(y, topk_ids, num_experts, x.dtype)


def _sorted_forward(x, w13, w2, topk_weights, topk_ids, lora, plan: MoEPlan):
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    dev = x.device
    t = _fit_gate_up_tile(plan.gate_up, inter)
    if plan.down.block_m != t.block_m:
        raise ValueError("gate_up and down share one alignment: block_m must match")
    has_lora = lora is not None
    if has_lora:  # blocks of one (expert, slot) group; pairs without an adapter in slot group -1
        aligned = moe_align(topk_ids, num_experts, t.block_m, lora.token_slots, lora.slot_ranks)
        groups_per_expert = lora.slot_ranks.numel() + 1
        ranks = lora.slot_ranks
    else:
        aligned = moe_align(topk_ids, num_experts, t.block_m)
        groups_per_expert, ranks = 1, topk_ids
    gu_lora, gu_strides, d_lora, d_strides = _lora_operands(lora, x)
    num_blocks = aligned.block_groups.numel()

    gu = torch.empty(num_pairs, two_i, dtype=x.dtype, device=dev)
    _moe_gate_up_kernel[(num_blocks * triton.cdiv(two_i, t.block_n),)](
        x, w13, gu, aligned.sorted_ids, aligned.block_groups, ranks, *gu_lora,
        num_pairs, top_k, two_i, hidden, groups_per_expert,
        x.stride(0), w13.stride(0), w13.stride(1), gu.stride(0), *gu_strides,
        HAS_LORA=has_lora, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        BLOCK_R=plan.lora_rank_block, EVEN_K=hidden % t.block_k == 0,
        num_warps=t.num_warps, num_stages=t.num_stages)

    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=dev)
    t = plan.down
    _moe_down_kernel[(num_blocks * triton.cdiv(hidden, t.block_n),)](
        gu, w2, y, topk_weights, aligned.sorted_ids, aligned.block_groups, ranks, *d_lora,
        num_pairs, hidden, inter, groups_per_expert,
        gu.stride(0), w2.stride(0), w2.stride(1), y.stride(0), *d_strides,
        HAS_LORA=has_lora, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        BLOCK_R=plan.lora_rank_block, EVEN_K=inter % t.block_k == 0,
        num_warps=t.num_warps, num_stages=t.num_stages)
    return _topk_sum(y, topk_ids, num_experts, x.dtype)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    lora: MoELoRAArgs | None = None,
    *,
    decode: bool | None = None,
    plan: MoEPlan | None = None,
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights/topk_ids [T, K] -> [T, H] in x.dtype.
    `decode` forces the GEMV (True) or sorted (False) path; `plan` overrides block sizes."""
    num_tokens, hidden = x.shape
    if w13.shape[2] != hidden or w2.shape[1] != hidden or w2.shape[2] * 2 != w13.shape[1]:
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)}")
    if num_tokens == 0:
        return torch.empty_like(x)
    if plan is None:
        plan = default_plan(num_tokens, topk_ids.shape[1], decode)
    x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()  # no-ops for loaded weights
    topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.contiguous()
    forward = _decode_forward if plan.decode else _sorted_forward
    return forward(x, w13, w2, topk_weights, topk_ids, lora, plan)


# ---------------------------------------------------------------------------------------------
# reference


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    lora: MoELoRAArgs | None = None,
) -> torch.Tensor:
    """Plain fp32 torch, one (token, k) pair at a time. The test oracle."""
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    inter = w2.shape[2]
    ids = topk_ids.tolist()
    weights = topk_weights.float()
    slots = lora.token_slots.tolist() if lora is not None else [-1] * num_tokens
    ranks = lora.slot_ranks.tolist() if lora is not None else []
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    for t in range(num_tokens):
        xt = x[t].float()
        s = slots[t]
        for k in range(top_k):
            e = ids[t][k]
            if not 0 <= e < num_experts:
                continue
            gate_up = w13[e].float() @ xt
            if s >= 0 and ranks[s] > 0:
                r = ranks[s]
                b = lora.gate_up_b[s, e, :, :r].float()
                a = lora.gate_up_a[s, e, :, :r].float()
                gate_up = gate_up + torch.cat([b[:inter] @ (a[0] @ xt), b[inter:] @ (a[1] @ xt)])
            h = F.silu(gate_up[:inter]) * gate_up[inter:]
            y = w2[e].float() @ h
            if s >= 0 and ranks[s] > 0:
                r = ranks[s]
                y = y + lora.down_b[s, e, :, :r].float() @ (lora.down_a[s, e, :r].float() @ h)
            out[t] += weights[t, k] * y
    return out.to(x.dtype)
