"""Fused MoE forward (routed experts, SiLU-gated) with optional per-token LoRA on the experts.

    out[t] = sum_k w[t,k] * (W2_e @ h + dD),   e = topk_ids[t,k]
    h = silu(g) * u,  [g | u] = W13_e @ x_t + dGU
    dGU = [Bg A x_t | Bu A' x_t],  A' = the slot's up A where it has separate gate and up A's, else A

Two paths, chosen from the number of (token, k) pairs only (so a CUDA graph of a batch
size always records the same kernels):

- decode (few pairs): no alignment. GEMV-style programs, one per (pair, N tile), read the
  pair's expert rows directly; LoRA shrinks run per pair and their expands are fused into
  the GEMV epilogues.
- sorted (many pairs): pairs are aligned into blocks of one expert (moe_align), then two
  grouped GEMMs: gate_up -> [pairs, 2I], and down with SiLU*up fused into its A-operand
  load, routing weight applied in the epilogue. LoRA: shrinks grouped by the same expert
  blocks run before each GEMM (moe_lora), and the expands are added in the GEMM epilogues
  (before the routing weight), walking the block's adapter slots into the accumulator itself,
  so each touched adapter-expert weight is read about once per block and gu / y are written
  once. A second, (slot, expert) alignment with separate LoRA kernels measured slower or equal
  on the H200 (MoE + 4 rank-16 adapters / MoE at T = 16/64/256/512: 1.43/1.42/1.45/1.53
  against 1.26/1.37/1.49/1.54 here) and was removed after cfefc5c.

Both paths end with a top-k sum over fp32 per-pair outputs (no atomics). `lora=None`
launches no LoRA work at all. No host syncs anywhere: every buffer and grid is sized from
shapes, and inactive rows (slot -1, rank 0, padding) exit or are masked inside the kernels.
"""

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moeserve.kernels import pdl as pdl_launch
from moeserve.kernels.moe_align import moe_align
from moeserve.kernels.moe_plan import MoEPlan, MoEProblem, default_plan
from moeserve.kernels.moe_lora import (
    RANK_STEP,
    lora_block_epilogue,
    lora_block_shrink,
    lora_rank_block,
    lora_shrink_pairs,
    silu_mul,
)


@dataclass(frozen=True)
class MoELoRAArgs:
    token_slots: torch.Tensor  # [T] int32, adapter slot of each token, -1 = no adapter
    slot_ranks: torch.Tensor  # [L] int32, rank of each slot (0 = empty); columns >= rank are zero
    gate_up_a: torch.Tensor  # [L, E, R, H]
    gate_up_b: torch.Tensor  # [L, E, 2I, R]  (LoRA scaling folded in)
    down_a: torch.Tensor  # [L, E, R, I]
    down_b: torch.Tensor  # [L, E, H, R]
    # pools with separate gate and up A's (lora_separate_gate_up): the up rows' own A, read only for slots
    # flagged 1 in gate_up_separate [L] int32; None: every slot's up rows use gate_up_a (no UP_HALF code)
    up_a: torch.Tensor | None = None  # [L, E, R, H], gate_up_a's layout
    gate_up_separate: torch.Tensor | None = None

    def __post_init__(self):
        # the expands read a B row's rank columns in whole 16-column steps masked at the row's stride (the pool's
        # rank; what lies past a slot's rank there is zero), so the rows must be packed: no other columns between
        for name in ("gate_up_b", "down_b"):
            b = getattr(self, name)
            if b.stride(-1) != 1 or b.stride(-2) != b.shape[-1]:
                raise ValueError(f"LoRA {name} {tuple(b.shape)} must hold its rows packed along the rank (strides "
                                 f"[..., {b.shape[-1]}, 1]), not {tuple(b.stride())}")


# ---------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _block_tile(pid, num_n, GROUP_M: tl.constexpr):
    """(expert block, N tile) of a program. GROUP_M > 1: programs walk GROUP_M blocks for each N tile before
    the next N tile, so the blocks' activations and the experts' weight columns are reused from L2 by
    programs running together; GROUP_M 1: every N tile of one block, then the next block."""
    if GROUP_M == 1:
        return pid // num_n, pid % num_n
    num_m = tl.num_programs(0) // num_n
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % rows, (pid % per_group) // rows


@triton.jit
def _weight_tile(b_ptrs, w_desc, row0, k0, K, offs_k, EVEN_K: tl.constexpr, W_TMA: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] weight tile of one K step: by pointers, or (W_TMA) by a Hopper TMA descriptor over the
    weights as a [E * N, K] matrix (rows past an expert's N are the next expert's, or zeros past the last one: the
    output mask drops their columns; columns past K are zeros), which frees the registers and instructions the
    pointer loads spend on addresses."""
    if W_TMA:
        return w_desc.load([row0, k0]).T
    elif EVEN_K:
        return tl.load(b_ptrs)
    else:
        return tl.load(b_ptrs, mask=(offs_k < K - k0)[:, None], other=0.0)


@triton.jit(do_not_specialize=["num_pairs"])  # sizes that vary by step: one compile
def _moe_gate_up_kernel(
    x_ptr, w_ptr, gu_ptr, sorted_ids_ptr, block_groups_ptr,
    slots_ptr, ranks_ptr, lora_b_ptr, shrunk_ptr,
    num_pairs, top_k, N, K,
    stride_xt, stride_we, stride_wn, stride_gu,
    stride_sk, stride_sr, stride_bl, stride_be, stride_bn,
    separate_ptr, stride_sh, up_col0, w_desc,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_LORA: tl.constexpr, K_SPLITS: tl.constexpr, RANK_STEP: tl.constexpr,
    UP_HALF: tl.constexpr, USE_PDL: tl.constexpr, GROUP_M: tl.constexpr = 1, W_TMA: tl.constexpr = False,
):
    """gu[pair] = W13_e @ x[token] (+ B (A x) of the pair's adapter) for the BLOCK_M pairs of one
    aligned block, one N tile. The LoRA shrink comes precomputed (lora_block_shrink); UP_HALF:
    columns >= up_col0 of slots flagged separate expand its up half (see lora_block_expand). With
    LoRA the kernel waits for the shrink just launched only before its epilogue (late wait)."""
    pdl_launch.enter_late(USE_PDL, HAS_LORA)
    pid_m, pid_n = _block_tile(tl.program_id(0), tl.cdiv(N, BLOCK_N), GROUP_M)
    expert = tl.load(block_groups_ptr + pid_m)
    if expert < 0:
        pdl_launch.late(USE_PDL, HAS_LORA)
        return
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :]
    b_ptrs = (w_ptr + expert.to(tl.int64) * stride_we
              + (offs_n % N).to(tl.int64)[None, :] * stride_wn + offs_k[:, None])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=pair_ok[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=pair_ok[:, None] & (offs_k < K - k0)[None, :], other=0.0)
        b = _weight_tile(b_ptrs, w_desc, expert * N + pid_n * BLOCK_N, k0, K, offs_k, EVEN_K, W_TMA)
        acc = tl.dot(a, b.to(a.dtype), acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    pdl_launch.late(USE_PDL, HAS_LORA)
    if HAS_LORA:
        acc = lora_block_epilogue(acc, pid_m, pairs, pair_ok, top_k, slots_ptr, ranks_ptr, shrunk_ptr,
                                  lora_b_ptr, expert, offs_n, N, stride_sk, stride_sr, stride_bl,
                                  stride_be, stride_bn, separate_ptr, stride_sh, up_col0, BLOCK_M,
                                  K_SPLITS, RANK_STEP, UP_HALF)
    out_ptrs = gu_ptr + pairs.to(tl.int64)[:, None] * stride_gu + offs_n[None, :]
    tl.store(out_ptrs, acc.to(gu_ptr.dtype.element_ty),
             mask=pair_ok[:, None] & (offs_n < N)[None, :])


@triton.jit(do_not_specialize=["num_pairs"])  # sizes that vary by step: one compile
def _moe_down_kernel(
    gu_ptr, w_ptr, y_ptr, topk_weights_ptr, sorted_ids_ptr, block_groups_ptr,
    slots_ptr, ranks_ptr, lora_b_ptr, shrunk_ptr,
    num_pairs, top_k, N, K,
    stride_gu, stride_we, stride_wn, stride_y,
    stride_sk, stride_sr, stride_bl, stride_be, stride_bn, w_desc,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_LORA: tl.constexpr, K_SPLITS: tl.constexpr, RANK_STEP: tl.constexpr, USE_PDL: tl.constexpr,
    GROUP_M: tl.constexpr = 1, FUSED_ACT: tl.constexpr = True, W_TMA: tl.constexpr = False,
):
    """y[pair] = w[pair] * (W2_e @ h (+ B (A h) of the pair's adapter)), h = silu(g) * u applied
    as the A tile is loaded (FUSED_ACT; else gu_ptr holds h itself, [pairs, K]); the routing weight scales
    base and delta together. y is stored in y_ptr's dtype."""
    pdl_launch.enter_late(USE_PDL, HAS_LORA)
    pid_m, pid_n = _block_tile(tl.program_id(0), tl.cdiv(N, BLOCK_N), GROUP_M)
    expert = tl.load(block_groups_ptr + pid_m)
    if expert < 0:
        pdl_launch.late(USE_PDL, HAS_LORA)
        return
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pairs < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    gate_ptrs = gu_ptr + pairs.to(tl.int64)[:, None] * stride_gu + offs_k[None, :]
    b_ptrs = (w_ptr + expert.to(tl.int64) * stride_we
              + (offs_n % N).to(tl.int64)[None, :] * stride_wn + offs_k[:, None])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            gate = tl.load(gate_ptrs, mask=pair_ok[:, None], other=0.0)
            if FUSED_ACT:
                up = tl.load(gate_ptrs + K, mask=pair_ok[:, None], other=0.0)
        else:
            k_ok = offs_k < K - k0
            gate = tl.load(gate_ptrs, mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
            if FUSED_ACT:
                up = tl.load(gate_ptrs + K, mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        b = _weight_tile(b_ptrs, w_desc, expert * N + pid_n * BLOCK_N, k0, K, offs_k, EVEN_K, W_TMA)
        if FUSED_ACT:
            a = silu_mul(gate.to(tl.float32), up.to(tl.float32)).to(b.dtype)
        else:
            a = gate
        acc = tl.dot(a, b, acc)
        gate_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    pdl_launch.late(USE_PDL, HAS_LORA)
    if HAS_LORA:  # no up halves here: slots_ptr stands in for the unread separate flags
        acc = lora_block_epilogue(acc, pid_m, pairs, pair_ok, top_k, slots_ptr, ranks_ptr, shrunk_ptr,
                                  lora_b_ptr, expert, offs_n, N, stride_sk, stride_sr, stride_bl,
                                  stride_be, stride_bn, slots_ptr, 0, N, BLOCK_M, K_SPLITS, RANK_STEP,
                                  False)
    weights = tl.load(topk_weights_ptr + pairs, mask=pair_ok, other=0.0).to(tl.float32)
    acc = acc * weights[:, None]
    out_ptrs = y_ptr + pairs.to(tl.int64)[:, None] * stride_y + offs_n[None, :]
    tl.store(out_ptrs, acc.to(y_ptr.dtype.element_ty), mask=pair_ok[:, None] & (offs_n < N)[None, :])


@triton.jit
def _silu_mul_kernel(gu_ptr, h_ptr, N, stride_gu, stride_h, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr):
    """h[pair] = silu(gu[pair, :N]) * gu[pair, N:] (rows of unrouted pairs hold garbage and are never read)."""
    pdl_launch.enter(USE_PDL)
    pair = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = offs < N
    gate = tl.load(gu_ptr + pair * stride_gu + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + pair * stride_gu + N + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(h_ptr + pair * stride_h + offs, silu_mul(gate, up).to(h_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _pair_slot(slots_ptr, ranks_ptr, token):
    """(slot, rank) of a token's adapter, rank 0 without one. No kernel of a step writes either, so a late kernel
    may read them before its wait (kernels/pdl.py, early reads): the FP8 expert GEMV does (its epilogue then loads
    the shrink's partials and B at once); the bf16 GEMVs read them after it, where held through the K loop they
    measured 0.3-0.7 % slower at 1-4 rows."""
    slot = tl.load(slots_ptr + token).to(tl.int32)
    rank = tl.load(ranks_ptr + tl.maximum(slot, 0))
    return slot, tl.where(slot >= 0, rank, 0)


@triton.jit
def _lora_expand_rows(
    slot, rank, b_ptr, shrunk_ptr, pair, expert, rows,
    stride_bl, stride_be, stride_bn, stride_sp, stride_ss, num_splits,
    separate_ptr, stride_sh, up_row0,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, UP_HALF: tl.constexpr,
):
    """B[slot, expert][rows, :rank] @ (sum over splits of shrunk[pair, split, :rank]);
    zero when the token has no adapter (slot, rank: _pair_slot). UP_HALF: rows >= up_row0 of a slot flagged
    separate use the up half (shrunk + stride_sh), which other slots never read."""
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    offs_s = tl.arange(0, BLOCK_S)
    part_ptrs = (shrunk_ptr + pair.to(tl.int64) * stride_sp + offs_s[:, None] * stride_ss
                 + offs_r[None, :])
    part_mask = (offs_s < num_splits)[:, None] & r_ok[None, :]
    shrunk = tl.sum(tl.load(part_ptrs, mask=part_mask, other=0.0), 0)[None, :]
    b_ptrs = (b_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bl + expert.to(tl.int64) * stride_be
              + rows.to(tl.int64)[:, None] * stride_bn + offs_r[None, :])
    # B masked at the rank rounded up to a 16-column step (and the pool's rank, stride_bn: rows packed): the shrink is
    # 0 past the rank and the pool holds zeros there, and a row's step stays 16-byte vector loads (see _expand_step_loads)
    b = tl.load(b_ptrs, mask=((offs_r < (rank + 15) // 16 * 16) & (offs_r < stride_bn))[None, :], other=0.0)
    if UP_HALF:
        rank_up = tl.where(tl.load(separate_ptr + tl.maximum(slot, 0)) != 0, rank, 0)
        up_mask = (offs_s < num_splits)[:, None] & (offs_r < rank_up)[None, :]
        shrunk_up = tl.sum(tl.load(part_ptrs + stride_sh, mask=up_mask, other=0.0), 0)
        shrunk = tl.where(((rows >= up_row0) & (rank_up > 0))[:, None], shrunk_up[None, :], shrunk)
    return tl.sum(b.to(tl.float32) * shrunk, 1)


@triton.jit
def _gemv_gate_up_kernel(
    x_ptr, w_ptr, gu_ptr, topk_ids_ptr,
    slots_ptr, ranks_ptr, lora_b_ptr, shrunk_ptr,
    num_experts, top_k, N, K,
    stride_xt, stride_we, stride_wn, stride_gu,
    stride_bl, stride_be, stride_bn, stride_sp, stride_ss, num_splits,
    separate_ptr, stride_sh, up_row0,
    HAS_LORA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, EVEN_K: tl.constexpr, UP_HALF: tl.constexpr, USE_PDL: tl.constexpr,
):
    """gu[pair, tile] = W13_e[tile] @ x[token] (+ LoRA expand), fp32; one program per (pair, tile)."""
    pdl_launch.enter_late(USE_PDL, HAS_LORA)  # with LoRA: the shrink just launched runs under the K walk
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(topk_ids_ptr + pair).to(tl.int32)
    if (expert < 0) | (expert >= num_experts):
        pdl_launch.late(USE_PDL, HAS_LORA)
        return
    token = pair // top_k
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = (w_ptr + expert.to(tl.int64) * stride_we
              + rows.to(tl.int64)[:, None] * stride_wn + offs_k[None, :])
    x_ptrs = x_ptr + token.to(tl.int64) * stride_xt + offs_k
    delta = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_LORA and not USE_PDL:  # issued before the main loop so its loads overlap the weight stream
        slot, rank = _pair_slot(slots_ptr, ranks_ptr, token)
        delta = _lora_expand_rows(slot, rank, lora_b_ptr, shrunk_ptr, pair,
                                  expert, rows, stride_bl, stride_be, stride_bn, stride_sp,
                                  stride_ss, num_splits, separate_ptr, stride_sh, up_row0,
                                  BLOCK_R, BLOCK_S, UP_HALF)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs)
            xv = tl.load(x_ptrs)
        else:
            k_ok = offs_k < K - k0
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
            xv = tl.load(x_ptrs, mask=k_ok, other=0.0)
        acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out = tl.sum(acc, 1)
    pdl_launch.late(USE_PDL, HAS_LORA)
    if HAS_LORA and USE_PDL:  # after the wait: the shrink ran under the loop above
        slot, rank = _pair_slot(slots_ptr, ranks_ptr, token)
        delta = _lora_expand_rows(slot, rank, lora_b_ptr, shrunk_ptr, pair,
                                  expert, rows, stride_bl, stride_be, stride_bn, stride_sp,
                                  stride_ss, num_splits, separate_ptr, stride_sh, up_row0,
                                  BLOCK_R, BLOCK_S, UP_HALF)
    if HAS_LORA:
        out += delta
    tl.store(gu_ptr + pair.to(tl.int64) * stride_gu + offs_n, out, mask=offs_n < N)


@triton.jit
def _gemv_down_kernel(
    gu_ptr, w_ptr, y_ptr, topk_weights_ptr, topk_ids_ptr,
    slots_ptr, ranks_ptr, lora_b_ptr, shrunk_ptr,
    num_experts, top_k, N, K,
    stride_gu, stride_we, stride_wn, stride_y,
    stride_bl, stride_be, stride_bn, stride_sp, stride_ss, num_splits,
    HAS_LORA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    """y[pair, tile] = w[pair] * (W2_e[tile] @ silu(g) * u (+ LoRA expand)), fp32."""
    pdl_launch.enter_late(USE_PDL, HAS_LORA)  # with LoRA: the shrink just launched runs under the K walk
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(topk_ids_ptr + pair).to(tl.int32)
    if (expert < 0) | (expert >= num_experts):
        pdl_launch.late(USE_PDL, HAS_LORA)
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = (w_ptr + expert.to(tl.int64) * stride_we
              + rows.to(tl.int64)[:, None] * stride_wn + offs_k[None, :])
    gate_ptrs = gu_ptr + pair.to(tl.int64) * stride_gu + offs_k
    delta = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_LORA and not USE_PDL:
        slot, rank = _pair_slot(slots_ptr, ranks_ptr, pair // top_k)
        delta = _lora_expand_rows(slot, rank, lora_b_ptr, shrunk_ptr, pair,
                                  expert, rows, stride_bl, stride_be, stride_bn,
                                  stride_sp, stride_ss, num_splits, slots_ptr, 0, 0,
                                  BLOCK_R, BLOCK_S, False)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
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
        acc += w.to(tl.float32) * silu_mul(gate, up)[None, :]
        w_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
    out = tl.sum(acc, 1)
    pdl_launch.late(USE_PDL, HAS_LORA)
    if HAS_LORA and USE_PDL:  # after the wait: the shrink ran under the loop above
        slot, rank = _pair_slot(slots_ptr, ranks_ptr, pair // top_k)
        delta = _lora_expand_rows(slot, rank, lora_b_ptr, shrunk_ptr, pair,
                                  expert, rows, stride_bl, stride_be, stride_bn,
                                  stride_sp, stride_ss, num_splits, slots_ptr, 0, 0,
                                  BLOCK_R, BLOCK_S, False)
    if HAS_LORA:
        out += delta
    out = out * tl.load(topk_weights_ptr + pair).to(tl.float32)
    tl.store(y_ptr + pair.to(tl.int64) * stride_y + offs_n, out, mask=offs_n < N)


@triton.jit
def _topk_sum_kernel(
    y_ptr, topk_ids_ptr, out_ptr, num_experts, top_k, N, stride_y, stride_out,
    BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr,
):
    """out[t] = sum_k y[t*K + k] over pairs with a valid expert (others were never written)."""
    pdl_launch.enter(USE_PDL)
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in range(0, top_k):
        pair = token * top_k + k
        expert = tl.load(topk_ids_ptr + pair + offs_n * 0)  # broadcast: one mask dtype everywhere
        ok = n_ok & (expert >= 0) & (expert < num_experts)
        acc += tl.load(y_ptr + pair.to(tl.int64) * stride_y + offs_n, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + token.to(tl.int64) * stride_out + offs_n,
             acc.to(out_ptr.dtype.element_ty), mask=n_ok)


# ---------------------------------------------------------------------------------------------
# launchers


def silu_mul_rows(gu: torch.Tensor, pdl: bool) -> torch.Tensor:
    """h [pairs, I] = silu(gu[:, :I]) * gu[:, I:] by its own kernel (the plans' separate activation)."""
    num_pairs, inter = gu.shape[0], gu.shape[1] // 2
    h = torch.empty(num_pairs, inter, dtype=gu.dtype, device=gu.device)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(num_pairs, triton.cdiv(inter, block))](
        gu, h, inter, gu.stride(0), h.stride(0), BLOCK_N=block, USE_PDL=pdl, launch_pdl=pdl, num_warps=4)
    return h


def _topk_sum(y: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, out_dtype, pdl: bool) -> torch.Tensor:
    num_tokens, top_k = topk_ids.shape
    n = y.shape[1]
    out = torch.empty(num_tokens, n, dtype=out_dtype, device=y.device)
    block_n = min(1024, triton.next_power_of_2(n))
    _topk_sum_kernel[(num_tokens, triton.cdiv(n, block_n))](
        y, topk_ids, out, num_experts, top_k, n, y.stride(0), out.stride(0),
        BLOCK_N=block_n, USE_PDL=pdl, launch_pdl=pdl, num_warps=4)
    return out


@functools.lru_cache(maxsize=None)
def _has_tma(device: torch.device) -> bool:
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9


def tma_readable(w: torch.Tensor) -> bool:
    """Whether a TMA descriptor can read expert weights w [E, N, K] as one [E * N, K] matrix: contiguous, 16-byte
    aligned rows, on a GPU with TMA (Hopper or later) or under the interpreter."""
    if not w.is_contiguous() or w.data_ptr() % 16 or (w.shape[-1] * w.element_size()) % 16:
        return False
    return _has_tma(w.device)


def weight_descs(w13: torch.Tensor, w2: torch.Tensor, plan: MoEPlan) -> tuple:
    """(gate_up weights, down weights, W_TMA): TMA descriptors in the plan's [block_n, block_k] boxes where the plan
    asks for them and both weights allow them, else the tensors themselves (unread placeholders) and pointer loads."""
    if not (plan.weights_tma and tma_readable(w13) and tma_readable(w2)):
        return w13, w2, False
    return (TensorDescriptor.from_tensor(w13.view(-1, w13.shape[-1]), [plan.gate_up.block_n, plan.gate_up.block_k]),
            TensorDescriptor.from_tensor(w2.view(-1, w2.shape[-1]), [plan.down.block_n, plan.down.block_k]), True)


def _decode_forward(x, w13, w2, topk_weights, topk_ids, lora, plan: MoEPlan, pdl: bool):
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    dev = x.device
    gu = torch.empty(num_pairs, two_i, dtype=torch.float32, device=dev)

    has_lora = lora is not None
    block_r = lora_rank_block(lora) if has_lora else 16
    up_half = has_lora and lora.up_a is not None
    if has_lora:  # partials [pairs, (2 halves,) splits, R]
        shrunk_gu = lora_shrink_pairs(x, lora.gate_up_a, topk_ids, lora, from_gate_up=False, up_a=lora.up_a,
                                      pdl=pdl)
        gu_b = lora.gate_up_b
        gu_b_args = (*gu_b.stride()[:3], shrunk_gu.stride(0), shrunk_gu.stride(-2), shrunk_gu.shape[-2],
                     lora.gate_up_separate if up_half else topk_ids, shrunk_gu.stride(1) if up_half else 0, inter)
        gu_lora = (lora.token_slots, lora.slot_ranks, gu_b, shrunk_gu)
        gu_splits = triton.next_power_of_2(shrunk_gu.shape[-2])
    else:
        gu_b_args, gu_splits = (0, 0, 0, 0, 0, 0, topk_ids, 0, 0), 1
        gu_lora = (topk_ids, topk_ids, x, x)  # unused placeholders

    t = plan.gate_up
    _gemv_gate_up_kernel[(num_pairs, triton.cdiv(two_i, t.block_n))](
        x, w13, gu, topk_ids, *gu_lora,
        num_experts, top_k, two_i, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), gu.stride(0), *gu_b_args,
        HAS_LORA=has_lora, BLOCK_N=t.block_n, BLOCK_K=t.block_k, BLOCK_R=block_r,
        BLOCK_S=gu_splits, EVEN_K=hidden % t.block_k == 0, UP_HALF=up_half,
        USE_PDL=pdl, launch_pdl=pdl, num_warps=t.num_warps, num_stages=t.num_stages)

    if has_lora:
        shrunk_d = lora_shrink_pairs(gu, lora.down_a, topk_ids, lora, from_gate_up=True, pdl=pdl)
        d_b = lora.down_b
        d_b_args = (*d_b.stride()[:3], *shrunk_d.stride()[:2], shrunk_d.shape[1])
        d_lora = (lora.token_slots, lora.slot_ranks, d_b, shrunk_d)
        d_splits = triton.next_power_of_2(shrunk_d.shape[1])
    else:
        d_b_args, d_splits = (0, 0, 0, 0, 0, 0), 1
        d_lora = (topk_ids, topk_ids, x, x)
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=dev)
    t = plan.down
    _gemv_down_kernel[(num_pairs, triton.cdiv(hidden, t.block_n))](
        gu, w2, y, topk_weights, topk_ids, *d_lora,
        num_experts, top_k, hidden, inter,
        gu.stride(0), w2.stride(0), w2.stride(1), y.stride(0), *d_b_args,
        HAS_LORA=has_lora, BLOCK_N=t.block_n, BLOCK_K=t.block_k, BLOCK_R=block_r,
        BLOCK_S=d_splits, EVEN_K=inter % t.block_k == 0, USE_PDL=pdl, launch_pdl=pdl,
        num_warps=t.num_warps, num_stages=t.num_stages)
    return _topk_sum(y, topk_ids, num_experts, x.dtype, pdl)


def _sorted_forward(x, w13, w2, topk_weights, topk_ids, lora, plan: MoEPlan, pdl: bool):
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    dev = x.device
    t = plan.gate_up
    if plan.down.block_m != t.block_m:
        raise ValueError("gate_up and down share one alignment: block_m must match")
    has_lora = lora is not None
    aligned = moe_align(topk_ids, num_experts, t.block_m, pdl=pdl)
    num_blocks = aligned.block_groups.numel()
    up_half = has_lora and lora.up_a is not None

    def shrink(from_gate_up, src, splits, activated=False):
        a = lora.down_a if from_gate_up else lora.gate_up_a
        return lora_block_shrink(src, a, aligned, lora, top_k, from_gate_up=from_gate_up,
                                 block_k=plan.lora_shrink_block_k, splits=splits,
                                 lanes=plan.lora_shrink_lanes, num_warps=plan.lora_shrink_warps,
                                 num_stages=plan.lora_shrink_stages,
                                 up_a=lora.up_a if up_half and not from_gate_up else None, pdl=pdl,
                                 activated=activated)

    def epilogue_lora(from_gate_up, src, splits, activated=False):
        """Launch args of a GEMM's LoRA epilogue; runs the shrink of that GEMM's input first."""
        if not has_lora:
            return (topk_ids, topk_ids, x, x), (0,) * 5, 1  # unused placeholders
        b = lora.down_b if from_gate_up else lora.gate_up_b  # rows packed (MoELoRAArgs checked)
        shrunk = shrink(from_gate_up, src, splits, activated)
        return ((lora.token_slots, lora.slot_ranks, b, shrunk),
                (shrunk.stride(-3), shrunk.stride(-2), *b.stride()[:3]), shrunk.shape[-3])

    gu = torch.empty(num_pairs, two_i, dtype=x.dtype, device=dev)
    w13_desc, w2_desc, w_tma = weight_descs(w13, w2, plan)
    ptrs, strides, k_splits = epilogue_lora(False, x, plan.lora_gate_up_splits)
    halves = (lora.gate_up_separate, ptrs[3].stride(0), inter) if up_half else (topk_ids, 0, two_i)
    _moe_gate_up_kernel[(num_blocks * triton.cdiv(two_i, t.block_n),)](
        x, w13, gu, aligned.sorted_ids, aligned.block_groups, *ptrs,
        num_pairs, top_k, two_i, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), gu.stride(0), *strides, *halves, w13_desc,
        W_TMA=w_tma, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        EVEN_K=hidden % t.block_k == 0, HAS_LORA=has_lora, K_SPLITS=k_splits,
        RANK_STEP=RANK_STEP, UP_HALF=up_half, GROUP_M=t.group_m, USE_PDL=pdl, launch_pdl=pdl,
        num_warps=t.num_warps, num_stages=t.num_stages)

    # the down GEMM's A: gu with SiLU*up applied as it loads, or h computed by its own kernel
    fused_act = plan.fused_act
    act = gu if fused_act else silu_mul_rows(gu, pdl)
    y = torch.empty(num_pairs, hidden, dtype=torch.float32 if plan.y_fp32 else x.dtype, device=dev)
    t = plan.down
    # the down shrink reads h where a kernel wrote it (H200, T=256: 42 us from gu's gate and up, 18 from h at 1,024)
    ptrs, strides, k_splits = epilogue_lora(True, act, plan.lora_down_splits, activated=not fused_act)
    _moe_down_kernel[(num_blocks * triton.cdiv(hidden, t.block_n),)](
        act, w2, y, topk_weights, aligned.sorted_ids, aligned.block_groups, *ptrs,
        num_pairs, top_k, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), y.stride(0), *strides, w2_desc,
        W_TMA=w_tma, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        EVEN_K=inter % t.block_k == 0, HAS_LORA=has_lora, K_SPLITS=k_splits,
        RANK_STEP=RANK_STEP, GROUP_M=t.group_m, FUSED_ACT=fused_act,
        USE_PDL=pdl, launch_pdl=pdl, num_warps=t.num_warps, num_stages=t.num_stages)
    return _topk_sum(y, topk_ids, num_experts, x.dtype, pdl)


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
    pdl: bool = False,
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights/topk_ids [T, K] -> [T, H] in x.dtype.
    `decode` forces the GEMV (True) or sorted (False) path; `plan` overrides block sizes; `pdl`: every launch
    with programmatic dependent launch (kernels/pdl.py). Each LoRA shrink is launched right before the GEMM or
    GEMV whose epilogue reads it, which then runs its main loop under the shrink (late wait)."""
    num_tokens, hidden = x.shape
    if w13.shape[2] != hidden or w2.shape[1] != hidden or w2.shape[2] * 2 != w13.shape[1]:
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)}")
    if num_tokens == 0:
        return torch.empty_like(x)
    if plan is None:
        problem = MoEProblem(w13.shape[0], hidden, w2.shape[2], topk_ids.shape[1], x.dtype, x.device)
        plan = default_plan(num_tokens, topk_ids.shape[1], decode, lora=lora is not None, problem=problem)
    x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()  # no-ops for loaded weights
    topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.contiguous()
    forward = _decode_forward if plan.decode else _sorted_forward
    return forward(x, w13, w2, topk_weights, topk_ids, lora, plan, pdl)


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
    separate = set()  # slots whose up rows use their own up A
    if lora is not None and lora.up_a is not None:
        separate = {s for s, f in enumerate(lora.gate_up_separate.tolist()) if f}
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
                a = lora.gate_up_a[s, e, :r].float()
                a_up = lora.up_a[s, e, :r].float() if s in separate else a
                b = lora.gate_up_b[s, e, :, :r].float()
                gate_up = gate_up + torch.cat([b[:inter] @ (a @ xt), b[inter:] @ (a_up @ xt)])
            h = F.silu(gate_up[:inter]) * gate_up[inter:]
            y = w2[e].float() @ h
            if s >= 0 and ranks[s] > 0:
                r = ranks[s]
                y = y + lora.down_b[s, e, :, :r].float() @ (lora.down_a[s, e, :r].float() @ h)
            out[t] += weights[t, k] * y
    return out.to(x.dtype)
