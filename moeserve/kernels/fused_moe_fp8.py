"""Fused MoE forward on block-wise FP8 expert weights, no LoRA inside.

    out[t] = sum_k w[t,k] * (W2_e @ silu(g) * u),   [g | u] = W13_e @ x_t,   W = W_fp8 * scale_inv per block

The two paths of fused_moe.py, chosen the same way (by pair count), with FP8 weights:

- sorted (many pairs): pairs aligned into expert blocks of BLOCK_M rows (moe_align), a grouped gate_up GEMM ->
  gu [pairs, 2I] in x's dtype, a grouped down GEMM with the routing weight in its epilogue -> y [pairs, H], then
  the top-k sum.
- decode (few pairs): GEMV programs per (pair, N tile) read the pair's expert rows directly, in fp32 on CUDA
  cores (decode reads weights: FP8 halves the bytes).

Two ways to multiply (`act_quant`), on both paths:

- weight-only (False): activations stay in x's dtype; each K step loads the fp8 weight tile, multiplies it by its
  block's scale_inv and runs the dot in x's dtype (fp32 accumulate). The down GEMM applies SiLU*up as it loads
  its A tile (MoEPlan.fused_act), as the bf16 path does.
- W8A8 (True): x quantized per (token, group of 128 along H) and h = silu(g)*u per (pair, group of 128 along I),
  dynamically, by their own kernels (kernels/fp8.py); fp8 x fp8 dots with fp32 accumulation, each K step's
  product scaled by act_scale[row, k-group] x scale_inv[n-block, k-group]. The GEMV path multiplies the same
  quantized activations (dequantized in fp32), so a token's numerics do not depend on the path.

Scale groups: a K step never crosses a 128-column group (BLOCK_K divides 128), and each output column reads its
own block row of scale_inv, so any BLOCK_N works. w13's scale rows are the gate's then the up's, each blocked
on its own ([E, 2 * ceil(I/128), ceil(H/128)]), as a checkpoint stores gate_proj and up_proj; with I a multiple of
128 that is the same as blocking the fused [2I, H] matrix.

LoRA (`lora`, MoELoRAArgs): the shrinks read x and h = silu(g) * u in x's dtype, never their fp8 copies (the
LoRA of a quantized base goes wrong exactly there). Rows without an adapter come out bitwise as in a call without
LoRA:
- decode (GEMV) path: as fused_moe's: the per-pair shrinks (moe_lora.lora_shrink_pairs, of x and of silu(g)*u read
  from gu) run before each GEMV, whose epilogue adds the pair's expand to its fp32 sum (gu before the down GEMV
  applies SiLU*up; y before the routing weight); a pair without an adapter adds an exact zero.
- sorted path (`lora_options` gives the shrinks' options): the bf16 path's LoRA epilogue on the FP8 GEMMs' own
  tiles, in one pass: each GEMM adds the expands into its scaled fp32 accumulator itself before the routing weight
  and its store, a row without an adapter adding exact zeros, so gu, h and y of such a row are the no-LoRA call's.
  Under W8A8 the activation kernel also writes the bf16 h it quantizes (silu_mul_quant_fp8's with_h), which the
  down shrink reads.
"""
from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moeserve.kernels import pdl as pdl_launch
from moeserve.kernels.fp8 import (
    FP8_DTYPE,
    WEIGHT_BLOCK,
    dequantize_block_fp8,
    fp8_scaled_dot,
    quantize_block_fp8,
    quantize_groups_fp8,
    quantize_groups_fp8_ref,
    silu_mul_quant_fp8,
    silu_mul_quant_fp8_ref,
)
from moeserve.kernels.fused_moe import (
    _block_tile,
    _lora_expand_rows,
    _pair_slot,
    _topk_sum,
    _weight_tile,
    silu_mul_rows,
    weight_descs,
)
from moeserve.kernels.moe_align import moe_align
from moeserve.kernels.moe_lora import (
    RANK_STEP,
    lora_block_epilogue,
    lora_block_shrink,
    lora_rank_block,
    lora_shrink_pairs,
    silu_mul,
)
from moeserve.kernels.moe_plan import (
    MoEPlan,
    MoEProblem,
    default_plan,
    fit_tile,
    gpu_name,
    heuristic_plan,
    smem_limit,
    tuned_tiles,
)

# ---------------------------------------------------------------------------------------------
# weight layout


def quantize_w13_fp8(w13: torch.Tensor, block: tuple[int, int] = WEIGHT_BLOCK):
    """w13 [E, 2I, H] = [gate; up] -> (fp8 [E, 2I, H], scale_inv [E, 2 * ceil(I/bn), ceil(H/bk)]): gate and up
    blocked each on its own, as a checkpoint's gate_proj and up_proj are."""
    inter = w13.shape[1] // 2
    (qg, sg), (qu, su) = quantize_block_fp8(w13[:, :inter], block), quantize_block_fp8(w13[:, inter:], block)
    return torch.cat([qg, qu], 1), torch.cat([sg, su], 1)


def dequantize_w13_fp8(w13_fp8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = WEIGHT_BLOCK,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    inter = w13_fp8.shape[1] // 2
    half = scale_inv.shape[1] // 2
    return torch.cat([dequantize_block_fp8(w13_fp8[:, :inter], scale_inv[:, :half], block, dtype),
                      dequantize_block_fp8(w13_fp8[:, inter:], scale_inv[:, half:], block, dtype)], 1)


# ---------------------------------------------------------------------------------------------
# kernel


@triton.jit(do_not_specialize=["num_pairs"])  # sizes that vary by step: one compile
def _moe_fp8_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, topk_weights_ptr, sorted_ids_ptr, block_groups_ptr,
    num_pairs, pairs_per_row, N, K, up_col0, up_scale_row0,
    stride_a, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_out,
    slots_ptr, ranks_ptr, lora_b_ptr, shrunk_ptr, top_k,
    stride_sk, stride_sr, stride_bl, stride_be, stride_bn, separate_ptr, stride_sh, w_desc,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, ACT_FP8: tl.constexpr, FUSED_ACT: tl.constexpr,
    ROUTE_WEIGHT: tl.constexpr, GROUP_M: tl.constexpr, USE_PDL: tl.constexpr, SCALE_PRODUCT: tl.constexpr = False,
    HAS_LORA: tl.constexpr = False, K_SPLITS: tl.constexpr = 1, RANK_STEP: tl.constexpr = 16,
    UP_HALF: tl.constexpr = False, B_SCALAR: tl.constexpr = False, W_TMA: tl.constexpr = False,
):
    """out[pair] = (w[pair] *) (dequant(W_e) @ a[pair // pairs_per_row] (+ B (A v) of the pair's adapter)) for the
    BLOCK_M pairs of one aligned block, one N tile. gate_up: a = x (rows are tokens, pairs_per_row = top_k); down:
    a = gu or h (rows are pairs). FUSED_ACT (weight-only down): the A tile is silu(a[:, k]) * a[:, K + k]. ACT_FP8:
    a is fp8 with scales a_scale[row, k-group]. Column n reads scale row n // SCALE_N, or for n >= up_col0
    up_scale_row0 + (n - up_col0) // SCALE_N (w13's separately blocked up half). SCALE_PRODUCT: see
    fp8_scaled_dot. B_SCALAR: the tile's columns share one scale row (BLOCK_N divides SCALE_N and the up half
    starts on a tile boundary), loaded once per K step as a scalar. W_TMA: weight tiles through a TMA descriptor
    over [E * N, K] (fused_moe._weight_tile). HAS_LORA: the bf16 path's in-place LoRA epilogue
    (moe_lora.lora_block_epilogue), its shrink of the unquantized x or h precomputed in shrunk_ptr, added into the
    scaled fp32 accumulator before the routing weight (a row without an adapter adds exact zeros); UP_HALF: gate_up
    of a pool with separate up A's (columns >= up_col0 are the up rows), walked. With LoRA the kernel waits for the
    shrink launched just before it only before its epilogue (pdl's late wait)."""
    pdl_launch.enter_late(USE_PDL, HAS_LORA)
    pid_m, pid_n = _block_tile(tl.program_id(0), tl.cdiv(N, BLOCK_N), GROUP_M)
    expert = tl.load(block_groups_ptr + pid_m)
    if expert < 0:
        pdl_launch.late(USE_PDL, HAS_LORA)
        return
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pairs < num_pairs
    rows = (pairs // pairs_per_row).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_a + offs_k[None, :]
    b_ptrs = (w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wn + offs_k[:, None])
    # B_SCALAR: the tile's first column stands for all (past N they wrap, and the store drops them)
    scale_cols = pid_n * BLOCK_N if B_SCALAR else cols
    scale_rows = tl.where(scale_cols < up_col0, scale_cols // SCALE_N,
                          up_scale_row0 + (scale_cols - up_col0) // SCALE_N)
    b_scale_ptrs = w_scale_ptr + expert.to(tl.int64) * stride_wse + scale_rows * stride_wsn
    a_scale_ptrs = a_scale_ptr + rows * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_scale = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a_mask = pair_ok[:, None]
        else:
            a_mask = pair_ok[:, None] & (offs_k < K - k0)[None, :]
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        if FUSED_ACT:
            up = tl.load(a_ptrs + K, mask=a_mask, other=0.0)
        b = _weight_tile(b_ptrs, w_desc, expert * N + pid_n * BLOCK_N, k0, K, offs_k, EVEN_K, W_TMA)
        if FUSED_ACT:
            a = silu_mul(a.to(tl.float32), up.to(tl.float32)).to(up.dtype)
        group = k0 // SCALE_K
        b_scale = tl.load(b_scale_ptrs + group)
        if ACT_FP8:
            a_scale = tl.load(a_scale_ptrs + group, mask=pair_ok, other=0.0)
        acc = fp8_scaled_dot(acc, a, b, a_scale, b_scale, ACT_FP8, SCALE_PRODUCT, B_SCALAR)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    pdl_launch.late(USE_PDL, HAS_LORA)
    if HAS_LORA:
        acc = lora_block_epilogue(acc, pid_m, pairs, pair_ok, top_k, slots_ptr, ranks_ptr, shrunk_ptr, lora_b_ptr,
                                  expert, offs_n, N, stride_sk, stride_sr, stride_bl, stride_be, stride_bn,
                                  separate_ptr, stride_sh, up_col0, BLOCK_M, K_SPLITS, RANK_STEP, UP_HALF)
    if ROUTE_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pairs, mask=pair_ok, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_out + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=pair_ok[:, None] & (offs_n < N)[None, :])


@triton.jit
def _gemv_fp8_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, topk_weights_ptr, topk_ids_ptr,
    num_experts, pairs_per_row, N, K, up_col0, up_scale_row0,
    stride_a, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_out,
    slots_ptr, ranks_ptr, lora_b_ptr, shrunk_ptr, top_k,
    stride_bl, stride_be, stride_bn, stride_sp, stride_ss, num_splits, separate_ptr, stride_sh, lora_up_row0,
    BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, SUB_K: tl.constexpr, EVEN_K: tl.constexpr,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, ACT_FP8: tl.constexpr, FUSED_ACT: tl.constexpr,
    ROUTE_WEIGHT: tl.constexpr, USE_PDL: tl.constexpr,
    HAS_LORA: tl.constexpr = False, BLOCK_R: tl.constexpr = 16, BLOCK_S: tl.constexpr = 1,
    UP_HALF: tl.constexpr = False, LORA_LATE: tl.constexpr = False,
):
    """Decode: out[pair, tile] = (w[pair] *) dequant(W_e)[tile] @ a[pair // pairs_per_row] in fp32 on CUDA cores,
    one program per (pair, N tile), no alignment (fused_moe's GEMV path with FP8 rows: half the bytes). Each K
    step covers GROUPS x SUB_K columns as a [BLOCK_N, GROUPS, SUB_K] tile, SUB_K inside one scale group, so a
    step may span several groups (an fp8 step needs twice the columns of a bf16 one for the same bytes in
    flight). Operands as in _moe_fp8_gemm_kernel; under ACT_FP8 the activation is dequantized by its group scale
    (the W8A8 numerics, for results that do not depend on the path). HAS_LORA: the pair's LoRA expand (its shrink
    already in shrunk_ptr, fp32 partials) added to the fp32 sum before the routing weight, as fused_moe's GEMV
    epilogue does (rows without an adapter add an exact zero). LORA_LATE (HAS_LORA, weight-only: the kernel just
    before is the LoRA shrink, and a, written earlier, is x or gu): the K walk runs under the shrink, and the wait
    comes before the expand (kernels/pdl.py, late wait), the pair's slot and rank read before it."""
    pdl_launch.enter_late(USE_PDL, LORA_LATE)
    pair = tl.program_id(0)
    expert = tl.load(topk_ids_ptr + pair).to(tl.int32)
    if (expert < 0) | (expert >= num_experts):
        pdl_launch.late(USE_PDL, LORA_LATE)
        return
    if HAS_LORA:
        slot, rank = _pair_slot(slots_ptr, ranks_ptr, pair // top_k)
    row = (pair // pairs_per_row).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = offs_n % N
    sub = tl.arange(0, GROUPS) * SUB_K  # first column of each sub-step
    offs_k = sub[:, None] + tl.arange(0, SUB_K)[None, :]  # [GROUPS, SUB_K]
    w_ptrs = (w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[:, None, None] * stride_wn
              + offs_k[None, :, :])
    a_ptrs = a_ptr + row * stride_a + offs_k
    scale_rows = tl.where(cols < up_col0, cols // SCALE_N, up_scale_row0 + (cols - up_col0) // SCALE_N)
    w_scale_ptrs = w_scale_ptr + expert.to(tl.int64) * stride_wse + scale_rows * stride_wsn
    acc = tl.zeros((BLOCK_N, GROUPS, SUB_K), dtype=tl.float32)
    for k0 in range(0, K, GROUPS * SUB_K):
        groups = (k0 + sub) // SCALE_K  # [GROUPS]
        if EVEN_K:
            w = tl.load(w_ptrs)
            a = tl.load(a_ptrs).to(tl.float32)
            if FUSED_ACT:
                a = silu_mul(a, tl.load(a_ptrs + K).to(tl.float32))
            w_scale = tl.load(w_scale_ptrs[:, None] + groups[None, :])
            if ACT_FP8:
                a = a * tl.load(a_scale_ptr + row * stride_as + groups)[:, None]
        else:
            k_ok = offs_k < K - k0
            g_ok = sub < K - k0
            w = tl.load(w_ptrs, mask=k_ok[None, :, :], other=0.0)
            a = tl.load(a_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            if FUSED_ACT:
                a = silu_mul(a, tl.load(a_ptrs + K, mask=k_ok, other=0.0).to(tl.float32))
            w_scale = tl.load(w_scale_ptrs[:, None] + groups[None, :], mask=g_ok[None, :], other=0.0)
            if ACT_FP8:
                a = a * tl.load(a_scale_ptr + row * stride_as + groups, mask=g_ok, other=0.0)[:, None]
        acc += (w.to(tl.float32) * w_scale[:, :, None]) * a[None, :, :]
        w_ptrs += GROUPS * SUB_K
        a_ptrs += GROUPS * SUB_K
    out = tl.sum(tl.sum(acc, 2), 1)
    pdl_launch.late(USE_PDL, LORA_LATE)
    if HAS_LORA:
        out += _lora_expand_rows(slot, rank, lora_b_ptr, shrunk_ptr, pair, expert, cols,
                                 stride_bl, stride_be, stride_bn, stride_sp, stride_ss, num_splits, separate_ptr,
                                 stride_sh, lora_up_row0, BLOCK_R, BLOCK_S, UP_HALF)
    if ROUTE_WEIGHT:
        out = out * tl.load(topk_weights_ptr + pair).to(tl.float32)
    tl.store(out_ptr + pair.to(tl.int64) * stride_out + offs_n, out, mask=offs_n < N)


# ---------------------------------------------------------------------------------------------
# plans

MAX_W8A8_TILE = 128 * 128  # accumulator elements of a W8A8 program (128 x 256 would hold two 128-register tiles)
# Pairs at or below this run the GEMV path in FP8 (bf16: DECODE_MAX_PAIRS). H200, Qwen3-30B-A3B shapes (session 13
# sweep): the sorted W8A8 GEMMs beat every GEMV tile at T = 8 (81.9 us against 99.2), the weight-only GEMV wins at
# T = 1 (21.3 against 27.5)
FP8_DECODE_MAX_PAIRS = 32
# K step of the FP8 GEMV (both decode tiles; bf16's are 256 and 128 columns): H200 sweep, T = 1 / 2, 21.3 / 32.8 us
# against 26.0 / 40.1 at 512 columns
FP8_GEMV_BLOCK_K = 256


def resolve_act_quant(act_quant: bool | None, decode: bool) -> bool:
    """`act_quant`, or for None the pick by path: W8A8 on the sorted path (fp8 tensor-core dots: at every T of the
    H200 sweep faster than weight-only, 1.4-1.7x from T = 256), weight-only on the GEMV path (a decode pair reads
    weights; quantizing its activations adds launches and saves nothing)."""
    return act_quant if act_quant is not None else not decode


def _table_label(act_quant: bool) -> str:
    """The dtype column of moe_tiles.json for FP8 expert weights multiplied this way."""
    return "fp8_w8a8" if act_quant else "fp8_w"


# pairs (lora_options); bounds on powers of two, as the warm-up's token counts reach every next_power_of_2(pairs)
FP8_LORA_TWO_LANES = (1025, 4096)


@functools.lru_cache(maxsize=4096)
def lora_options(num_tokens: int, top_k: int) -> MoEPlan:
    """The LoRA options of an FP8 sorted-path call: the heuristic's shrinks (moe_plan.LORA_SHRINKS_UNSPLIT). Its
    tiles are not read (fp8_plan gives those). (H200, W8A8, 4 rank-16 adapters, (MoE + LoRA) / MoE with the expands
    in the GEMM epilogues / apart after plain GEMMs: 1.16 / 1.45 at T = 16, 1.36 / 1.51 at 256, 1.54 / 1.75 at 512,
    1.65 / 1.81 at 4,096; the engine's prefill with every prompt on an adapter 0.720 / 0.627 of base; session 16
    calls 2-4. The apart expands were removed after f6bc547.) From 1,025 to 4,096 pairs (64-row blocks) the block's
    slots are dealt to 2 programs, not 4 (W8A8, 4 rank-16 adapters, (MoE + LoRA) / MoE: T = 256 1.302 against 1.328,
    512 1.428 against 1.442; 8 lanes, 2 or 8 warps, K steps of 256, stages 2 / 4 and splits lost or tied; session 24,
    benchmarks/session24/fp8_lora_sweep.py)."""
    plan = heuristic_plan(num_tokens, top_k, decode=False, lora=True)
    if FP8_LORA_TWO_LANES[0] <= num_tokens * top_k <= FP8_LORA_TWO_LANES[1]:
        plan = replace(plan, lora_shrink_lanes=2)
    return plan


@functools.lru_cache(maxsize=4096)  # called per MoE layer per eager step, as default_plan
def fp8_plan(num_tokens: int, top_k: int, problem: MoEProblem, act_quant: bool | None,
             block: tuple[int, int] = WEIGHT_BLOCK, decode: bool | None = None) -> MoEPlan:
    """The path by pair count (FP8_DECODE_MAX_PAIRS; `decode` forcing one) and its tiles: on the sorted path the
    tuned table's FP8 rows for this problem and multiplication (moe_tiles.json, dtype "fp8_w8a8" / "fp8_w"), else
    the bf16 call's tiles refitted; every K step inside one scale group, the tiles fitted to the operands' bytes (fp8
    B; A fp8 under W8A8, else x's dtype). `act_quant` None: the pick of resolve_act_quant (the plan holds no
    multiplication; the caller resolves it the same way)."""
    if decode is None:
        decode = num_tokens * top_k <= FP8_DECODE_MAX_PAIRS
    act_quant = resolve_act_quant(act_quant, decode)
    plan = default_plan(num_tokens, top_k, decode=decode, problem=replace(problem, dtype=torch.bfloat16))

    def in_group(tile):
        return replace(tile, block_k=min(tile.block_k, block[1]))

    if plan.decode:  # a K step may span scale groups (the GEMV dequantizes per group inside it)
        return replace(plan, gate_up=replace(plan.gate_up, block_k=FP8_GEMV_BLOCK_K),
                       down=replace(plan.down, block_k=FP8_GEMV_BLOCK_K))
    tuned = tuned_tiles(num_tokens, problem, gpu_name(problem.device), dtype_label=_table_label(act_quant))
    # weight tiles by TMA only where an FP8 row of the table asks for it (the bf16 rows' answer is not FP8's)
    plan = replace(plan, weights_tma=False)
    if tuned is not None and tuned[0].block_m == tuned[1].block_m:
        plan = replace(plan, gate_up=tuned[0], down=tuned[1], **tuned[2])
    limit = smem_limit(problem.device)
    a_bytes = 1 if act_quant else problem.dtype.itemsize
    fused_act = plan.fused_act and not act_quant  # W8A8 quantizes h by its own kernel

    def fit(tile, a_loads):
        tile = in_group(tile)
        if act_quant:  # each K step's fp8 product lives beside the accumulator until scaled: at most 128 x 128 each
            tile = replace(tile, block_n=min(tile.block_n, max(64, MAX_W8A8_TILE // tile.block_m)))
        # fit_tile counts one element size for A and B: the A side's (the larger) keeps the fit on the safe side
        return fit_tile(tile, a_bytes, a_loads, limit)

    return replace(plan, gate_up=fit(plan.gate_up, 1), down=fit(plan.down, 2 if fused_act else 1),
                   fused_act=fused_act)


def _check_plan(plan: MoEPlan, block: tuple[int, int]) -> None:
    if not plan.decode and plan.gate_up.block_m != plan.down.block_m:
        raise ValueError("gate_up and down share one alignment: block_m must match")
    for name, t in (("gate_up", plan.gate_up), ("down", plan.down)):
        if block[1] % t.block_k and not (plan.decode and t.block_k % block[1] == 0):
            raise ValueError(f"{name} block_k {t.block_k} must divide the scale block {block[1]} (GEMV path: or be a "
                             "multiple of it): each K step, or GEMV sub-step, inside one scale group")


# ---------------------------------------------------------------------------------------------
# launcher


def _check_weights(x, w13, s13, w2, s2, block):
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    if x.shape[1] != hidden or tuple(w2.shape) != (num_experts, hidden, inter) or two_i % 2:
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if w13.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE:
        raise ValueError(f"FP8 expert weights must be {FP8_DTYPE}, got w13 {w13.dtype}, w2 {w2.dtype}")
    for name, t in (("w13_fp8", w13), ("w2_fp8", w2), ("w13_scale_inv", s13), ("w2_scale_inv", s2)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along its last dim, got strides {t.stride()}")
    bn, bk = block
    want13 = (num_experts, 2 * triton.cdiv(inter, bn), triton.cdiv(hidden, bk))
    want2 = (num_experts, triton.cdiv(hidden, bn), triton.cdiv(inter, bk))
    for name, s, want in (("w13_scale_inv", s13, want13), ("w2_scale_inv", s2, want2)):
        if tuple(s.shape) != want or s.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 {want} for blocks of {block}, got {s.dtype} {tuple(s.shape)}")


def _launch(a, a_scale, w, w_scale, out, topk_weights, aligned, num_pairs, pairs_per_row, n, k, up_col0,
            up_scale_row0, tile, block, act_fp8, fused_act, route_weight, scale_product, pdl, w_desc, w_tma,
            lora=None):
    """`w_desc`, `w_tma`: the weights' TMA descriptor and whether to read through it (weight_descs). `lora`:
    (MoELoRAArgs, its B for this GEMM, the block shrink of this GEMM's unquantized input (lora_block_shrink:
    [(2,) splits, rows, R], the up halves where the pool has them), top_k): the in-place LoRA epilogue."""
    num_blocks = aligned.block_groups.numel()
    # every N tile inside one scale block: BLOCK_N divides it, and the up half (w13) starts on a tile boundary
    scalar_b_scale = block[0] % tile.block_n == 0 and (up_col0 >= n or up_col0 % tile.block_n == 0)
    if lora is None:
        lora_args, lora_opts = (topk_weights,) * 4 + (1,) + (0,) * 5 + (topk_weights, 0), {}
    else:
        args, b, shrunk, top_k = lora  # b: a B of args, rows packed (MoELoRAArgs checked)
        up_half = shrunk.dim() == 4
        lora_args = (args.token_slots, args.slot_ranks, b, shrunk, top_k, shrunk.stride(-3), shrunk.stride(-2),
                     *b.stride()[:3], args.gate_up_separate if up_half else args.slot_ranks,
                     shrunk.stride(0) if up_half else 0)
        lora_opts = dict(HAS_LORA=True, K_SPLITS=shrunk.shape[-3], RANK_STEP=RANK_STEP, UP_HALF=up_half)
    _moe_fp8_gemm_kernel[(num_blocks * triton.cdiv(n, tile.block_n),)](
        a, a_scale, w, w_scale, out, topk_weights, aligned.sorted_ids, aligned.block_groups,
        num_pairs, pairs_per_row, n, k, up_col0, up_scale_row0,
        a.stride(0), a_scale.stride(0), w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1),
        out.stride(0), *lora_args, w_desc,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, EVEN_K=k % tile.block_k == 0,
        SCALE_N=block[0], SCALE_K=block[1], ACT_FP8=act_fp8, FUSED_ACT=fused_act, ROUTE_WEIGHT=route_weight,
        SCALE_PRODUCT=scale_product, GROUP_M=tile.group_m, USE_PDL=pdl, launch_pdl=pdl, num_warps=tile.num_warps,
        num_stages=tile.num_stages, B_SCALAR=scalar_b_scale, W_TMA=w_tma, **lora_opts)


def _launch_gemv(a, a_scale, w, w_scale, out, topk_weights, topk_ids, pairs_per_row, n, k, up_col0,
                 up_scale_row0, tile, block, act_fp8, fused_act, route_weight, pdl, lora=None):
    """`lora`: (MoELoRAArgs, its B for this GEMM, shrunk partials [pairs, (2,) splits, R], up-half rows or None)."""
    sub_k = min(tile.block_k, block[1])
    if lora is None:
        lora_args, lora_opts = (topk_ids, topk_ids, a, a, 1, 0, 0, 0, 0, 0, 1, topk_ids, 0, 0), {}
    else:
        args, b, shrunk, up_row0 = lora
        up_half = up_row0 is not None
        lora_args = (args.token_slots, args.slot_ranks, b, shrunk, topk_ids.shape[1], *b.stride()[:3],
                     shrunk.stride(0), shrunk.stride(-2), shrunk.shape[-2],
                     args.gate_up_separate if up_half else topk_ids, shrunk.stride(1) if up_half else 0,
                     up_row0 if up_half else 0)
        # weight-only: the shrink is the launch just before (under W8A8 the down GEMV has h quantized in between;
        # its gate_up would allow the late wait, not taken: W8A8 decode is not the default)
        lora_opts = dict(HAS_LORA=True, BLOCK_R=lora_rank_block(args), BLOCK_S=triton.next_power_of_2(shrunk.shape[-2]),
                         UP_HALF=up_half, LORA_LATE=not act_fp8)
    _gemv_fp8_kernel[(topk_ids.numel(), triton.cdiv(n, tile.block_n))](
        a, a_scale, w, w_scale, out, topk_weights, topk_ids,
        w.shape[0], pairs_per_row, n, k, up_col0, up_scale_row0,
        a.stride(0), a_scale.stride(0), w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1),
        out.stride(0), *lora_args,
        BLOCK_N=tile.block_n, GROUPS=tile.block_k // sub_k, SUB_K=sub_k, EVEN_K=k % tile.block_k == 0,
        SCALE_N=block[0], SCALE_K=block[1], ACT_FP8=act_fp8, FUSED_ACT=fused_act, ROUTE_WEIGHT=route_weight,
        USE_PDL=pdl, launch_pdl=pdl, num_warps=tile.num_warps, num_stages=tile.num_stages, **lora_opts)


def _decode_forward(x, w13, s13, w2, s2, topk_weights, topk_ids, act_quant, plan, block, pdl, scale_product,
                    lora=None, x_fp8=None):
    del scale_product  # the GEMV multiplies dequantized weights in fp32: nothing is rounded either way
    num_tokens, hidden = x.shape
    inter = w2.shape[2]
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if act_quant:
        a, a_scale = x_fp8 if x_fp8 is not None else quantize_groups_fp8(x, block[1], pdl=pdl)
    else:
        a, a_scale = x, topk_weights  # a_scale: an unread placeholder
    gu = torch.empty(num_pairs, 2 * inter, dtype=torch.float32, device=x.device)
    gu_lora = d_lora = None
    if lora is not None:  # the shrinks read x and silu(g) * u of gu (with the gate_up deltas), never fp8 copies
        shrunk = lora_shrink_pairs(x, lora.gate_up_a, topk_ids, lora, from_gate_up=False, up_a=lora.up_a, pdl=pdl)
        gu_lora = (lora, lora.gate_up_b, shrunk, inter if lora.up_a is not None else None)
    _launch_gemv(a, a_scale, w13, s13, gu, topk_weights, topk_ids, top_k, 2 * inter, hidden, inter,
                 triton.cdiv(inter, block[0]), plan.gate_up, block, act_quant, False, False, pdl, gu_lora)
    if lora is not None:
        d_lora = (lora, lora.down_b, lora_shrink_pairs(gu, lora.down_a, topk_ids, lora, from_gate_up=True, pdl=pdl),
                  None)
    if act_quant:
        h, h_scale = silu_mul_quant_fp8(gu, block[1], pdl=pdl)
    else:
        h, h_scale = gu, topk_weights  # SiLU*up applied as the down GEMV loads gu
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    _launch_gemv(h, h_scale, w2, s2, y, topk_weights, topk_ids, 1, hidden, inter, hidden, 0, plan.down, block,
                 act_quant, not act_quant, True, pdl, d_lora)
    return _topk_sum(y, topk_ids, w13.shape[0], x.dtype, pdl)


def _sorted_forward(x, w13, s13, w2, s2, topk_weights, topk_ids, act_quant, plan, block, pdl, scale_product,
                    lora=None, lora_plan: MoEPlan | None = None, x_fp8=None):
    """The sorted path. With `lora`, the shrinks of x and of h (never their fp8 copies; `lora_plan` gives their
    options), each launched just before its GEMM, whose epilogue adds the expands into its accumulator."""
    num_tokens, hidden = x.shape
    num_experts = w13.shape[0]
    inter = w2.shape[2]
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    aligned = moe_align(topk_ids, num_experts, plan.gate_up.block_m, pdl=pdl)
    w13_desc, w2_desc, w_tma = weight_descs(w13, w2, plan)
    lp = lora_plan
    has_lora = lora is not None

    def shrink(src, a, from_gate_up, splits, activated=True):
        return lora_block_shrink(src, a, aligned, lora, top_k, from_gate_up=from_gate_up,
                                 block_k=lp.lora_shrink_block_k, splits=splits, lanes=lp.lora_shrink_lanes,
                                 num_warps=lp.lora_shrink_warps, num_stages=lp.lora_shrink_stages, pdl=pdl,
                                 activated=from_gate_up and activated,
                                 up_a=lora.up_a if not from_gate_up else None)

    if act_quant:
        a, a_scale = x_fp8 if x_fp8 is not None else quantize_groups_fp8(x, block[1], pdl=pdl)
    else:
        a, a_scale = x, topk_weights  # a_scale: an unread placeholder
    # the shrink right before its GEMM, whose main loop reads only older data (pdl's late wait)
    shrunk_x = shrink(x, lora.gate_up_a, False, lp.lora_gate_up_splits) if has_lora else None
    gu = torch.empty(num_pairs, 2 * inter, dtype=x.dtype, device=x.device)
    _launch(a, a_scale, w13, s13, gu, topk_weights, aligned, num_pairs, top_k, 2 * inter, hidden,
            inter, triton.cdiv(inter, block[0]), plan.gate_up, block, act_quant, False, False, scale_product, pdl,
            w13_desc, w_tma, (lora, lora.gate_up_b, shrunk_x, top_k) if has_lora else None)

    fused_act = plan.fused_act and not act_quant
    if act_quant:  # with LoRA also the bf16 h it quantizes, for the down shrink
        h, h_scale, *h_plain = silu_mul_quant_fp8(gu, block[1], pdl=pdl, with_h=has_lora)
    elif fused_act:
        h, h_scale = gu, topk_weights
    else:
        h, h_scale = silu_mul_rows(gu, pdl), topk_weights
    # the down shrink reads the unquantized h, or gu where the down GEMM applies SiLU*up as it loads
    shrunk_h = shrink(h_plain[0] if act_quant else h, lora.down_a, True, lp.lora_down_splits,
                      activated=not fused_act) if has_lora else None
    y = torch.empty(num_pairs, hidden, dtype=torch.float32 if plan.y_fp32 else x.dtype, device=x.device)
    _launch(h, h_scale, w2, s2, y, topk_weights, aligned, num_pairs, 1, hidden, inter,
            hidden, 0, plan.down, block, act_quant, fused_act, True, scale_product, pdl, w2_desc, w_tma,
            (lora, lora.down_b, shrunk_h, top_k) if has_lora else None)
    return _topk_sum(y, topk_ids, num_experts, x.dtype, pdl)


def input_quant_group(x: torch.Tensor, w13_fp8: torch.Tensor, w2_fp8: torch.Tensor, top_k: int,
                      act_quant: bool | None, block: tuple[int, int] = WEIGHT_BLOCK) -> int:
    """The group size in which fused_moe_fp8(x, ...) with these weights reads x as fp8 (W8A8: quantized per (token,
    group of block[1] columns)), or 0 where it reads x unquantized: a producer that writes x can write that copy
    too (`x_fp8`)."""
    problem = MoEProblem(w13_fp8.shape[0], x.shape[-1], w2_fp8.shape[2], top_k, x.dtype, x.device)
    plan = fp8_plan(x.shape[0], top_k, problem, act_quant, block)
    return block[1] if resolve_act_quant(act_quant, plan.decode) else 0


def fused_moe_fp8(
    x: torch.Tensor,
    w13_fp8: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2_fp8: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    act_quant: bool | None,
    decode: bool | None = None,
    plan: MoEPlan | None = None,
    pdl: bool = False,
    block: tuple[int, int] = WEIGHT_BLOCK,
    weight_scale: str = "tile",
    lora=None,
    lora_plan: MoEPlan | None = None,
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [T, H] (bf16 / fp16 / fp32), w13_fp8 [E, 2I, H] and w2_fp8 [E, H, I] float8_e4m3fn with float32 scale_inv
    [E, 2 * ceil(I/128), ceil(H/128)] (gate's block rows, then up's) and [E, ceil(H/128), ceil(I/128)], topk_weights
    / topk_ids [T, K] -> [T, H] in x.dtype. `act_quant`: W8A8 (activations quantized per token-group of 128 at run
    time), False weight-only, None by path (resolve_act_quant: what the engine runs). `decode` forces the GEMV
    (True) or sorted (False) path (default: by pair count, FP8_DECODE_MAX_PAIRS); `plan`: the tiles (default
    `fp8_plan`); `pdl`: every launch with programmatic dependent launch (kernels/pdl.py). `weight_scale`
    (weight-only sorted path): "tile" dequantizes each fp8 weight tile before its dot, "product" scales each K
    step's product instead (fp8_scaled_dot's SCALE_PRODUCT). `lora_plan`: the sorted path's LoRA options
    (default `lora_options`). `x_fp8`: x already quantized as a W8A8 call reads it (input_quant_group; the norm
    that wrote x makes it), instead of a quantization launch here."""
    if weight_scale not in ("tile", "product"):
        raise ValueError(f"weight_scale {weight_scale!r}: choose 'tile' or 'product'")
    _check_weights(x, w13_fp8, w13_scale_inv, w2_fp8, w2_scale_inv, block)
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return torch.empty_like(x)
    problem = MoEProblem(w13_fp8.shape[0], hidden, w2_fp8.shape[2], topk_ids.shape[1], x.dtype, x.device)
    if plan is None:
        plan = fp8_plan(num_tokens, topk_ids.shape[1], problem, act_quant, block, decode)
    _check_plan(plan, block)
    act_quant = resolve_act_quant(act_quant, plan.decode)
    if x_fp8 is not None:
        groups = triton.cdiv(hidden, block[1])
        if not act_quant or x_fp8[0].shape != x.shape or x_fp8[1].shape != (num_tokens, groups) \
                or x_fp8[0].dtype != FP8_DTYPE or x_fp8[1].stride(1) != 1:
            raise ValueError(f"x_fp8: a W8A8 call's x quantized per {block[1]} columns, (fp8 {tuple(x.shape)}, "
                             f"row-major scale ({num_tokens}, {groups})); this call: act_quant {act_quant}")
    x, topk_weights, topk_ids = x.contiguous(), topk_weights.contiguous(), topk_ids.contiguous()
    args = (x, w13_fp8, w13_scale_inv, w2_fp8, w2_scale_inv, topk_weights, topk_ids, act_quant)
    if plan.decode:
        return _decode_forward(*args, plan, block, pdl, weight_scale == "product", lora, x_fp8)
    if lora is not None and lora_plan is None:
        lora_plan = lora_options(num_tokens, topk_ids.shape[1])
    return _sorted_forward(*args, plan, block, pdl, weight_scale == "product", lora, lora_plan, x_fp8)


# ---------------------------------------------------------------------------------------------
# reference


def fused_moe_fp8_ref(
    x: torch.Tensor,
    w13_fp8: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2_fp8: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    act_quant: bool,
    block: tuple[int, int] = WEIGHT_BLOCK,
    routed: bool | None = None,
) -> torch.Tensor:
    """Plain fp32 torch on the dequantized weights, expert by expert; `act_quant` quantizes x per token-group and h
    per pair-group with the kernels' twins first. The test oracle (act_quant False: the unquantized reference of both
    variants), and the torch MoE backend's W8A8. `routed` (default: on the CPU) runs each expert over the pairs routed
    to it; else over every row, weighted 0 where not routed (no host sync: a CUDA graph can hold it), as
    moe_experts_torch does."""
    _check_weights(x, w13_fp8, w13_scale_inv, w2_fp8, w2_scale_inv, block)
    w13 = dequantize_w13_fp8(w13_fp8, w13_scale_inv, block)
    w2 = dequantize_block_fp8(w2_fp8, w2_scale_inv, block)
    inter = w2.shape[2]
    xs = x.float()
    if act_quant:
        q, s = quantize_groups_fp8_ref(xs, block[1])
        xs = dequantize_block_fp8(q, s, (1, block[1]))
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    if routed is None:
        routed = x.device.type == "cpu"
    for e in range(w13.shape[0]):
        if routed:
            tokens, ks = (topk_ids == e).nonzero(as_tuple=True)
            if tokens.numel() == 0:
                continue
            weight = topk_weights[tokens, ks].float()[:, None]
        else:
            tokens = slice(None)
            weight = (topk_weights.float() * (topk_ids == e)).sum(-1, keepdim=True)
        gu = xs[tokens] @ w13[e].T
        if act_quant:
            h = dequantize_block_fp8(*silu_mul_quant_fp8_ref(gu, block[1]), (1, block[1]))
        else:
            h = F.silu(gu[:, :inter]) * gu[:, inter:]
        y = weight * (h @ w2[e].T)
        if routed:
            out.index_add_(0, tokens, y)
        else:
            out += y
    return out.to(x.dtype)
